/* flash_attn_tf32x3.cu: f32-accurate joint attention on tensor cores (pictor-diffusers).

   Algorithm: flash-attention v2 forward, non-causal, no mask, online softmax in
   the exp2 domain (scale * log2(e) folded into one FFMA). Both matrix products
   run on tensor cores in split-precision TF32 ("3xTF32"): each f32 operand x is
   split into hi = tf32(x) and lo = tf32(x - hi), and a.b is accumulated in f32
   as lo(a).hi(b) + hi(a).lo(b) + hi(a).hi(b). About 21 of f32's 24 mantissa
   bits survive per product, so results match the plain-f32 kernel
   (max-abs <= 1e-5 against float64 on N(0,1) inputs).

   Launch geometry (FT_D, FT_OUT_KIND, FT_BQ, FT_BK, FT_THREADS and
   FT_SMEM_BYTES come from the host as -D; static_asserts below check them
   against this kernel's own formulas):
       grid  = (ceil(seq_q / FT_BQ), num_heads, batch), FT_BQ = 128 query rows
       block = FT_THREADS = 256 = 8 warps; warp w owns rows 16w .. 16w+15
       dynamic shared memory = FT_SMEM_BYTES (FT_D = 128: 213.5 KiB, opted in)
           Q tile  [FT_BQ][FT_LDQ] (hi, lo) pairs, split once per block
           K tile  [FT_BK][FT_LDK] (hi, lo) pairs
           V tile  [FT_BK][FT_LDV] (hi, lo) pairs
           V raw   [FT_BK][FT_D] f32, the next V tile in flight (cp.async)
   Key tiles of FT_BK = 32 keys (any multiple of 8 that splits evenly over
   the threads): while a tile is computed, the next K tile is loaded into
   registers and the next V tile copied to shared memory; at the next tile
   each is split into hi/lo once, by all threads, for all warps.

   Matrix products: mma.sync.m16n8k8 TF32, f32 accumulators.
       S = Q K^T : A = Q fragment, B = K tile.
       O += P V  : A = P straight from the S accumulators. An accumulator holds
                   keys (2t, 2t+1) where the A fragment expects k = (t, t+4);
                   the product sums over keys, so k = t is read as key 2t and
                   k = t+4 as key 2t+1, and V's fragment uses the same map.
   Row strides (in 8-byte pairs) FT_LDQ = FT_LDK = FT_D + 4 and FT_LDV = FT_D + 2
   make every fragment load bank-conflict-free.

   Layout (a window of rows: the host offsets each pointer to the window's
   first row; pitches are the full tensors' row counts):
       q       : head-major  [batch, num_heads, q_pitch, FT_D] f32, 16-byte
                 aligned; rows [0, seq_q) computed
       k, v    : head-major  [batch, num_heads, kv_pitch, FT_D] f32, 16-byte
                 aligned; keys [0, seq_k) attended
       out     : token-major [batch, out_pitch, num_heads * FT_D]; f32, or the
                 16-bit bit patterns of bf16 / f16 (FT_OUT_KIND 1 / 2)
       lse     : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null, read by the FT_KEY_LENS=1 build only:
                 batch b attends its first key_lens[b] keys (attention_io.cuh)
   Precision: f32 inputs, 3xTF32 products, f32 softmax state and accumulators;
   the output is rounded once, to nearest even, into the output dtype. */

#include "attention_io.cuh"
#include "sm80_mma.cuh"
#include "softmax.cuh"

#if !defined(FT_D) || !defined(FT_OUT_KIND) || !defined(FT_BQ) || !defined(FT_BK) || !defined(FT_THREADS) \
    || !defined(FT_SMEM_BYTES)
#error "flash_attn_tf32x3.cu needs -D FT_D, FT_OUT_KIND, FT_BQ, FT_BK, FT_THREADS and FT_SMEM_BYTES from the host"
#endif
#if !defined(FT_KEY_LENS)
#error "flash_attn_tf32x3.cu needs -D FT_KEY_LENS=0 or 1 from the host"
#endif
#if FT_D % 32 != 0 || FT_D > 128
#error "FT_D must be 32, 64, 96 or 128"
#endif
#if FT_OUT_KIND < 0 || FT_OUT_KIND > 2
#error "FT_OUT_KIND must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif

#define FT_WARPS 8
#define FT_LDQ (FT_D + 4)
#define FT_LDK (FT_D + 4)
#define FT_LDV (FT_D + 2)
#define FT_KSTEPS (FT_D / 8)
#define FT_NTILES_S (FT_BK / 8)
#define FT_NTILES_O (FT_D / 8)
#define FT_PV_CHUNK 4                   /* output tiles per fresh P.V accumulator */
#define FT_F4_ROW (FT_D / 4)
#define FT_F4_PER_THREAD (FT_BK * FT_F4_ROW / FT_THREADS)
static_assert(FT_THREADS == FT_WARPS * 32, "FT_THREADS must be 256: the kernel runs 8 warps");
static_assert(FT_BQ == FT_WARPS * 16, "FT_BQ must be 128: 8 warps of 16 query rows");
static_assert(FT_BK % 8 == 0 && FT_BK * FT_F4_ROW % FT_THREADS == 0,
              "FT_BK: whole n8 tiles, and a K/V tile splits evenly over the threads");
static_assert(FT_NTILES_O % FT_PV_CHUNK == 0, "FT_PV_CHUNK must divide the output tiles");
static_assert(FT_SMEM_BYTES == (FT_BQ * FT_LDQ + FT_BK * FT_LDK + FT_BK * FT_LDV) * 8 + FT_BK * FT_D * 4,
              "FT_SMEM_BYTES disagrees with the kernel's Q | K | V | V raw tiles");

typedef pk_storage<FT_OUT_KIND>::type ft_out_t;

/* (hi, lo) TF32 bit patterns with x ~= hi + lo. */
__device__ __forceinline__ uint2 ft_split(float x)
{
    unsigned int hi, lo;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
    return make_uint2(hi, lo);
}

/* a.b in 3xTF32: c_big += hi.hi, c_cross += lo.hi + hi.lo.
   a[i] and b0/b1 are (hi, lo) pairs. */
__device__ __forceinline__ void ft_mma3(float* c_big, float* c_cross, const uint2* a, uint2 b0, uint2 b1)
{
    pk_mma_m16n8k8_tf32(c_cross, a[0].y, a[1].y, a[2].y, a[3].y, b0.x, b1.x);
    pk_mma_m16n8k8_tf32(c_cross, a[0].x, a[1].x, a[2].x, a[3].x, b0.y, b1.y);
    pk_mma_m16n8k8_tf32(c_big, a[0].x, a[1].x, a[2].x, a[3].x, b0.x, b1.x);
}

/* Rows [row0, row0 + FT_BK) of a head slice into registers, zeros past seq. */
__device__ __forceinline__ void ft_load_tile(const float4* __restrict__ src, unsigned int row0, unsigned int seq,
                                             float4* regs)
{
    #pragma unroll
    for (int i = 0; i < FT_F4_PER_THREAD; i++) {
        const unsigned int idx = threadIdx.x + i * FT_THREADS;
        const bool valid = row0 + idx / FT_F4_ROW < seq;
        regs[i] = valid ? src[(unsigned long long)row0 * FT_F4_ROW + idx] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

/* Start copying rows [row0, row0 + FT_BK) of a head slice into `raw` (f32,
   [FT_BK][FT_D]) with cp.async; rows past seq are zero-filled. */
__device__ __forceinline__ void ft_copy_tile_async(float* raw, const float4* __restrict__ src, unsigned int row0,
                                                   unsigned int seq)
{
    #pragma unroll
    for (int i = 0; i < FT_F4_PER_THREAD; i++) {
        const unsigned int idx = threadIdx.x + i * FT_THREADS;
        const bool valid = row0 + idx / FT_F4_ROW < seq;
        const float4* from = src + (valid ? (unsigned long long)row0 * FT_F4_ROW + idx : 0ull);
        pk_cp_async16_zfill(pk_smem_addr(raw + idx * 4), from, valid ? 16 : 0);
    }
    pk_cp_async_commit();
}

/* Split one float4 and store it as four (hi, lo) pairs at row/col of a tile. */
__device__ __forceinline__ void ft_store_split4(uint2* tile, unsigned int ld, unsigned int idx, float4 x)
{
    uint2* dst = tile + (idx / FT_F4_ROW) * ld + (idx % FT_F4_ROW) * 4;
    const uint2 a = ft_split(x.x), b = ft_split(x.y), c = ft_split(x.z), d = ft_split(x.w);
    *(uint4*)dst = make_uint4(a.x, a.y, b.x, b.y);
    *(uint4*)(dst + 2) = make_uint4(c.x, c.y, d.x, d.y);
}

extern "C" __global__ void __launch_bounds__(FT_THREADS, 1)
joint_attention_tf32x3(
    PK_POINTER_OPERANDS(float, ft_out_t),
    PK_POINTER_SCALARS,
    float scale_log2)
{
    extern __shared__ __align__(16) uint2 ft_smem[];
    uint2* Qs = ft_smem;
    uint2* Ks = Qs + FT_BQ * FT_LDQ;
    uint2* Vs = Ks + FT_BK * FT_LDK;
    float* V_raw = (float*)(Vs + FT_BK * FT_LDV);
#if FT_KEY_LENS
    PK_HOLD_KEYS(FT_OUT_KIND, FT_BQ, FT_D);    /* read after the key loop's first __syncthreads */
#define FT_KEYS PK_HELD_KEYS
#else
#define FT_KEYS seq_k
#endif

    const unsigned int h = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int q0 = blockIdx.x * FT_BQ;
    const unsigned int warp = threadIdx.x >> 5;
    const unsigned int g = (threadIdx.x & 31u) >> 2;
    const unsigned int t = threadIdx.x & 3u;
    const unsigned long long plane = (unsigned long long)b * num_heads + h;
    const float4* q4 = (const float4*)(q + plane * q_pitch * FT_D);
    const float4* k4 = (const float4*)(k + plane * kv_pitch * FT_D);
    const float4* v4 = (const float4*)(v + plane * kv_pitch * FT_D);

    for (unsigned int idx = threadIdx.x; idx < FT_BQ * FT_F4_ROW; idx += FT_THREADS) {
        const bool valid = q0 + idx / FT_F4_ROW < seq_q;
        const float4 x = valid ? q4[(unsigned long long)q0 * FT_F4_ROW + idx] : make_float4(0.f, 0.f, 0.f, 0.f);
        ft_store_split4(Qs, FT_LDQ, idx, x);
    }
    float4 k_next[FT_F4_PER_THREAD];
    ft_load_tile(k4, 0u, seq_k, k_next);
    ft_copy_tile_async(V_raw, v4, 0u, seq_k);

    float o[FT_NTILES_O][4];
    #pragma unroll
    for (int j = 0; j < FT_NTILES_O; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_run[2] = {PK_NEG_INF, PK_NEG_INF};   /* running max of scale*log2e*s, rows g, g+8 */
    float l_run[2] = {0.f, 0.f};                 /* this thread's part of the running sums */
    const uint2* Qw = Qs + warp * 16 * FT_LDQ;

    const unsigned int n_tiles = (seq_k + FT_BK - 1) / FT_BK;
    for (unsigned int tile = 0; tile < n_tiles; tile++) {
        const unsigned int k0 = tile * FT_BK;
        __syncthreads();
        pk_cp_async_wait_all();
        #pragma unroll
        for (int i = 0; i < FT_F4_PER_THREAD; i++) {
            const unsigned int idx = threadIdx.x + i * FT_THREADS;
            ft_store_split4(Ks, FT_LDK, idx, k_next[i]);
            ft_store_split4(Vs, FT_LDV, idx, *(const float4*)(V_raw + idx * 4));
        }
        __syncthreads();
        if (tile + 1 < n_tiles) {
            ft_load_tile(k4, k0 + FT_BK, FT_KEYS, k_next);
            ft_copy_tile_async(V_raw, v4, k0 + FT_BK, FT_KEYS);
        }

        /* hi.hi products and the two cross terms accumulate apart: tensor-core
           accumulation truncates, and keeping the large term alone limits
           that bias to one product per k-step. */
        float s[FT_NTILES_S][4];
        float s_cross[FT_NTILES_S][4];
        #pragma unroll
        for (int n = 0; n < FT_NTILES_S; n++) {
            #pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] = s_cross[n][c] = 0.f;
        }
        #pragma unroll
        for (int ks = 0; ks < FT_KSTEPS; ks++) {
            const uint2* qa = Qw + ks * 8 + t;
            const uint2 a[4] = {qa[g * FT_LDQ], qa[(g + 8) * FT_LDQ], qa[g * FT_LDQ + 4], qa[(g + 8) * FT_LDQ + 4]};
            #pragma unroll
            for (int n = 0; n < FT_NTILES_S; n++) {
                const uint2* kb = Ks + (n * 8 + g) * FT_LDK + ks * 8 + t;
                ft_mma3(s[n], s_cross[n], a, kb[0], kb[4]);
            }
        }
        #pragma unroll
        for (int n = 0; n < FT_NTILES_S; n++) {
            #pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] += s_cross[n][c];
        }

        pk_mask_tail<FT_NTILES_S>(&s[0][0], k0, FT_KEYS, t);
        float corr[2];
        pk_online_softmax<FT_NTILES_S, 1, false>(&s[0][0], m_run, l_run, corr, scale_log2);
        /* O = O * corr + P V. Each chunk of FT_PV_CHUNK output tiles sums this
           key tile in fresh accumulators and is added to O with IEEE-rounded
           FFMA, so truncation in the tensor cores never compounds across tiles. */
        #pragma unroll
        for (int j0 = 0; j0 < FT_NTILES_O; j0 += FT_PV_CHUNK) {
            float acc[FT_PV_CHUNK][4];
            #pragma unroll
            for (int jj = 0; jj < FT_PV_CHUNK; jj++) acc[jj][0] = acc[jj][1] = acc[jj][2] = acc[jj][3] = 0.f;
            #pragma unroll
            for (int n = 0; n < FT_NTILES_S; n++) {
                const uint2 a[4] = {ft_split(s[n][0]), ft_split(s[n][2]), ft_split(s[n][1]), ft_split(s[n][3])};
                const uint2* vb = Vs + (n * 8 + 2 * t) * FT_LDV + j0 * 8 + g;
                #pragma unroll
                for (int jj = 0; jj < FT_PV_CHUNK; jj++) {
                    ft_mma3(acc[jj], acc[jj], a, vb[jj * 8], vb[jj * 8 + FT_LDV]);
                }
            }
            #pragma unroll
            for (int jj = 0; jj < FT_PV_CHUNK; jj++) {
                #pragma unroll
                for (int c = 0; c < 4; c++) {
                    o[j0 + jj][c] = fmaf(o[j0 + jj][c], corr[c >> 1], acc[jj][c]);
                }
            }
        }
    }

    #pragma unroll
    for (int r = 0; r < 2; r++) l_run[r] = pk_quad_sum(l_run[r]);
    const unsigned long long inner = (unsigned long long)num_heads * FT_D;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const unsigned int row = q0 + warp * 16 + g + 8 * r;
        if (row >= seq_q) continue;
        const float inv = 1.f / l_run[r];
        const unsigned long long token = (unsigned long long)b * out_pitch + row;
        ft_out_t* dst = out + token * inner + (unsigned long long)h * FT_D + 2 * t;
        if (t == 0) pk_store_lse(lse, token * num_heads + h, m_run[r], l_run[r]);
        #pragma unroll
        for (int j = 0; j < FT_NTILES_O; j++) {
            pk_store2<FT_OUT_KIND>(dst + j * 8, o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
        }
    }
}
