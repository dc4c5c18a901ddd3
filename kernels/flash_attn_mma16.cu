/* flash_attn_mma16.cu: 16-bit joint attention on Ampere tensor cores (pictor-diffusers).

   Algorithm: flash-attention v2 forward, non-causal, no mask, online softmax in
   the exp2 domain (scale * log2(e) folded into one FFMA). Both matrix products
   run on mma.sync.m16n8k16 with bf16 / f16 operands and f32 accumulators. This
   is the portable fallback for sm_80, sm_86, sm_89 and sm_90.

   Launch geometry (MH_D, MH_IN_KIND, MH_BQ, MH_BK, MH_THREADS and
   MH_SMEM_BYTES come from the host as -D; static_asserts below check them
   against this kernel's own formulas):
       grid  = (ceil(seq_q / MH_BQ), num_heads, batch), MH_BQ = 128 query rows
       block = MH_THREADS = 128 = 4 warps; warp w owns rows 32w .. 32w+31 as
               two m16 tiles, so every K / V fragment feeds two MMAs
       dynamic shared memory = MH_SMEM_BYTES = (MH_BQ + 2 * MH_BK) * MH_LDB bytes,
           shared rows of MH_LDB = 2 * MH_D + 16 bytes:
           Q tile [MH_BQ] rows, loaded once, ldmatrix'ed at every key tile
           K tile [MH_BK] rows, V tile [MH_BK] rows
       MH_BK = 64 keys per tile:
           MH_D = 128: 69632 B = 68 KiB (opted in), MH_D = 64: 36864 B = 36 KiB
   Pipeline (cp.async.cg, 16 B, rows past the window zero-filled by src-size 0): the
   copy of V[j] runs under S = Q K[j]^T and the softmax, the copy of K[j+1]
   under O += P V[j]; two __syncthreads per key tile order the reuse.

   Matrix products: mma.sync.m16n8k16.row.col, f32 accumulators.
       S = Q K^T : A = Q by ldmatrix.x4, B = K by ldmatrix.x4 (key rows are n).
       O += P V  : A = P packed in registers from the S accumulators (the C
                   layout of n8 tiles 2kk, 2kk+1 is the A layout of k16 step
                   kk), B = V by ldmatrix.x4.trans.
   The 16-byte pad per shared row puts the eight rows an ldmatrix phase reads
   in eight distinct bank groups (row r starts at chunk 17r or 9r, = r mod 8),
   so every load is bank-conflict-free, and every fragment address is one
   per-lane register plus an immediate.
   Keys >= seq_k get logit -inf (every tile holds at least one valid key, so the
   running max stays finite after the first tile).

   Layout (a window of rows: the host offsets each pointer to the window's
   first row; pitches are the full tensors' row counts):
       q       : head-major  [batch, num_heads, q_pitch, MH_D] 16-bit bit
                 patterns (MH_IN_KIND 1: bfloat16, 2: float16), 16-byte
                 aligned; rows [0, seq_q) computed
       k, v    : head-major  [batch, num_heads, kv_pitch, MH_D], same dtype;
                 keys [0, seq_k) attended
       out     : token-major [batch, out_pitch, num_heads * MH_D], same dtype
       lse     : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null, read by the MH_KEY_LENS=1 build only:
                 batch b attends its first key_lens[b] keys (attention_io.cuh)
   Precision: f32 logits, softmax state and accumulators (exp2 and the final
   1 / l by the ex2.approx / rcp.approx units). P is rounded to the input
   dtype for P V (as FlashAttention-2 does); the row sums use the f32
   probabilities. The output is rounded once, to nearest even. */

#include "attention_io.cuh"
#include "sm80_mma.cuh"
#include "softmax.cuh"

#if !defined(MH_D) || !defined(MH_IN_KIND) || !defined(MH_BQ) || !defined(MH_BK) || !defined(MH_THREADS) \
    || !defined(MH_SMEM_BYTES)
#error "flash_attn_mma16.cu needs -D MH_D, MH_IN_KIND, MH_BQ, MH_BK, MH_THREADS and MH_SMEM_BYTES from the host"
#endif
#if !defined(MH_KEY_LENS)
#error "flash_attn_mma16.cu needs -D MH_KEY_LENS=0 or 1 from the host"
#endif
#if MH_D != 64 && MH_D != 128
#error "MH_D must be 64 or 128"
#endif
#if MH_IN_KIND != 1 && MH_IN_KIND != 2
#error "MH_IN_KIND must be 1 (bfloat16) or 2 (float16)"
#endif

#define MH_WARPS 4
#define MH_LDB (MH_D * 2 + 16)            /* shared row stride in bytes */
#define MH_CHUNKS (MH_D / 8)              /* 16-byte chunks per row */
#define MH_Q_BYTES (MH_BQ * MH_LDB)
#define MH_KV_BYTES (MH_BK * MH_LDB)
#define MH_KSTEPS (MH_D / 16)             /* k16 steps of S = Q K^T */
#define MH_STILES (MH_BK / 8)             /* n8 tiles of S per m16 tile */
#define MH_PSTEPS (MH_BK / 16)            /* k16 steps of O += P V */
#define MH_OTILES (MH_D / 8)              /* n8 tiles of O per m16 tile */
#define MH_RSTEP (MH_THREADS / MH_CHUNKS) /* rows one pass of the block copies */
static_assert(MH_THREADS == MH_WARPS * 32, "MH_THREADS must be 128: the kernel runs 4 warps");
static_assert(MH_BQ == MH_WARPS * 32, "MH_BQ must be 128: 4 warps of 32 query rows");
static_assert(MH_BK % 16 == 0 && MH_BK % MH_RSTEP == 0,
              "MH_BK: whole k16 steps of P V, and a K/V tile splits evenly over the threads");
static_assert(MH_SMEM_BYTES == MH_Q_BYTES + 2 * MH_KV_BYTES,
              "MH_SMEM_BYTES disagrees with the kernel's Q | K | V tiles");

/* Start copying ROWS rows of a head slice (src = its first row) into the
   tile at shared address dst; rows >= valid_rows are zero-filled. Thread i
   copies chunk i % MH_CHUNKS of rows i / MH_CHUNKS + MH_RSTEP * n. A full
   tile uses one pointer plus immediates; a partial one keeps every source
   address inside the head slice (a zero-filled row reads row 0's address). */
template <int ROWS>
__device__ __forceinline__ void mh_copy_tile(unsigned int dst, const unsigned short* __restrict__ src,
                                             unsigned int valid_rows)
{
    const unsigned int row0 = threadIdx.x / MH_CHUNKS;
    const unsigned int chunk = threadIdx.x % MH_CHUNKS;
    const unsigned int to = dst + row0 * MH_LDB + chunk * 16;
    const unsigned short* from = src + row0 * MH_D + chunk * 8;
    if (valid_rows >= ROWS) {
        #pragma unroll
        for (int n = 0; n < ROWS / MH_RSTEP; n++) {
            pk_cp_async16(to + n * MH_RSTEP * MH_LDB, from + n * MH_RSTEP * MH_D);
        }
    } else {
        #pragma unroll
        for (int n = 0; n < ROWS / MH_RSTEP; n++) {
            const bool valid = row0 + n * MH_RSTEP < valid_rows;
            pk_cp_async16_zfill(to + n * MH_RSTEP * MH_LDB, valid ? from + n * MH_RSTEP * MH_D : src,
                                valid ? 16 : 0);
        }
    }
}

/* Both m16 tiles of A times the two n8 tiles of one ldmatrix.x4 B load:
   c[mt][n], c[mt][n + 1] += a[mt] b. */
template <int N>
__device__ __forceinline__ void mh_mma_2x2(float (&c)[2][N][4], int n, const unsigned int (&a)[2][4],
                                           const unsigned int (&b)[4])
{
    #pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        pk_mma_m16n8k16<MH_IN_KIND>(c[mt][n], a[mt], b[0], b[1]);
        pk_mma_m16n8k16<MH_IN_KIND>(c[mt][n + 1], a[mt], b[2], b[3]);
    }
}

extern "C" __global__ void __launch_bounds__(MH_THREADS, 2)
joint_attention_mma16(
    PK_POINTER_OPERANDS(unsigned short, unsigned short),
    PK_POINTER_SCALARS,
    float scale_log2)
{
    extern __shared__ __align__(16) unsigned char mh_smem[];
    const unsigned int sQ = pk_smem_addr(mh_smem);
    const unsigned int sK = sQ + MH_Q_BYTES;
    const unsigned int sV = sK + MH_KV_BYTES;
#if MH_KEY_LENS
    PK_HOLD_KEYS(MH_IN_KIND, MH_BQ, MH_D);    /* read after the key loop's first __syncthreads */
#define MH_KEYS PK_HELD_KEYS
#else
#define MH_KEYS seq_k
#endif

    const unsigned int h = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int q0 = blockIdx.x * MH_BQ;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int g = lane >> 2;
    const unsigned int t = lane & 3u;
    const unsigned long long plane = (unsigned long long)b * num_heads + h;
    const unsigned long long kv_off = plane * kv_pitch * MH_D;
    const unsigned short* kh = k + kv_off;
    const unsigned short* vh = v + kv_off;

    mh_copy_tile<MH_BQ>(sQ, q + (plane * q_pitch + q0) * MH_D, seq_q - q0);
    mh_copy_tile<MH_BK>(sK, kh, seq_k);
    pk_cp_async_commit();

    /* ldmatrix row addresses: lane l feeds row l % 8 of matrix l / 8.
       Q (A, m16 x k16): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7),
                         (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3.
       K (B, 2 n8 tiles): (keys 0-7, k 0-7), (keys 0-7, k 8-15),
                          (keys 8-15, k 0-7), (keys 8-15, k 8-15)
                          = b0, b1 of tile 2p, b0, b1 of tile 2p+1.
       V (B, trans):      (keys 0-7, d 0-7), (keys 8-15, d 0-7),
                          (keys 0-7, d 8-15), (keys 8-15, d 8-15)
                          = b0, b1 of tile 2p, b0, b1 of tile 2p+1.
       The k16 step / d pair adds 32 bytes, an m16 / key block 16 rows. */
    const unsigned int q_addr = sQ + (warp * 32u + (lane & 15u)) * MH_LDB + (lane >> 4) * 16u;
    const unsigned int k_addr = sK + ((lane & 7u) + (lane >> 4) * 8u) * MH_LDB + ((lane >> 3) & 1u) * 16u;
    const unsigned int v_addr = sV + ((lane & 7u) + ((lane >> 3) & 1u) * 8u) * MH_LDB + (lane >> 4) * 16u;

    float o[2][MH_OTILES][4];
    #pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        #pragma unroll
        for (int j = 0; j < MH_OTILES; j++) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    }
    /* Row ri = 2 * mt + r is row 32 * warp + 16 * mt + g + 8 * r of the block. */
    float m_run[4] = {PK_NEG_INF, PK_NEG_INF, PK_NEG_INF, PK_NEG_INF};  /* max of scale*log2e*s */
    float l_run[4] = {0.f, 0.f, 0.f, 0.f};       /* this thread's part of the running sums */

    const unsigned int n_tiles = (seq_k + MH_BK - 1) / MH_BK;
    for (unsigned int tile = 0; tile < n_tiles; tile++) {
        const unsigned int k0 = tile * MH_BK;
        pk_cp_async_wait_all();
        __syncthreads();                  /* K[tile] (and Q) landed; V no longer read */
        mh_copy_tile<MH_BK>(sV, vh + (unsigned long long)k0 * MH_D, MH_KEYS - k0);
        pk_cp_async_commit();

        float s[2][MH_STILES][4];
        #pragma unroll
        for (int mt = 0; mt < 2; mt++) {
            #pragma unroll
            for (int n = 0; n < MH_STILES; n++) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        }
        #pragma unroll
        for (int ks = 0; ks < MH_KSTEPS; ks++) {
            unsigned int a[2][4];
            pk_ldsm_x4(q_addr + ks * 32, a[0]);
            pk_ldsm_x4(q_addr + 16 * MH_LDB + ks * 32, a[1]);
            #pragma unroll
            for (int p = 0; p < MH_STILES / 2; p++) {
                unsigned int bk[4];
                pk_ldsm_x4(k_addr + p * 16 * MH_LDB + ks * 32, bk);
                mh_mma_2x2(s, 2 * p, a, bk);
            }
        }

        pk_mask_tail<MH_STILES, 2>(&s[0][0][0], k0, MH_KEYS, t);
        float corr[4];
        pk_online_softmax<MH_STILES, 2, true>(&s[0][0][0], m_run, l_run, corr, scale_log2);
        pk_rescale<MH_OTILES, 2>(&o[0][0][0], corr);

        pk_cp_async_wait_all();
        __syncthreads();                  /* V[tile] landed; K no longer read */
        if (tile + 1 < n_tiles) {
            mh_copy_tile<MH_BK>(sK, kh + (unsigned long long)(k0 + MH_BK) * MH_D, MH_KEYS - k0 - MH_BK);
            pk_cp_async_commit();
        }

        #pragma unroll
        for (int kk = 0; kk < MH_PSTEPS; kk++) {
            unsigned int pa[2][4];
            #pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                pa[mt][0] = pk_pack2<MH_IN_KIND>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = pk_pack2<MH_IN_KIND>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = pk_pack2<MH_IN_KIND>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = pk_pack2<MH_IN_KIND>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            #pragma unroll
            for (int p = 0; p < MH_OTILES / 2; p++) {
                unsigned int bv[4];
                pk_ldsm_x4_trans(v_addr + kk * 16 * MH_LDB + p * 32, bv);
                mh_mma_2x2(o, 2 * p, pa, bv);
            }
        }
    }

    #pragma unroll
    for (int ri = 0; ri < 4; ri++) l_run[ri] = pk_quad_sum(l_run[ri]);
    #pragma unroll
    for (int ri = 0; ri < 4; ri++) {
        const int mt = ri >> 1, r = ri & 1;
        const unsigned int row = q0 + warp * 32u + mt * 16 + r * 8 + g;
        if (row >= seq_q) continue;
        const float inv = pk_rcp(l_run[ri]);
        const unsigned long long slot = ((unsigned long long)b * out_pitch + row) * num_heads + h;
        unsigned short* dst = out + slot * MH_D + 2 * t;
        if (t == 0) pk_store_lse(lse, slot, m_run[ri], l_run[ri]);
        #pragma unroll
        for (int j = 0; j < MH_OTILES; j++) {
            pk_store2<MH_IN_KIND>(dst + j * 8, o[mt][j][2 * r] * inv, o[mt][j][2 * r + 1] * inv);
        }
    }
}
