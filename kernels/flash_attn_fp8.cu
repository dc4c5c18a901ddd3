/* flash_attn_fp8.cu: 8-bit joint attention on Hopper tensor cores (pictor-diffusers).

   Algorithm: flash-attention forward, non-causal (key padding in the
   F8_KEY_LENS=1 build), with flash_attn_wgmma.cu's warp-specialised schedule
   (on sm90_pipeline.cuh and sm90_wgmma.cuh):
   a TMA producer warpgroup, two consumer warpgroups of 64 query rows that
   issue S_j = Q K_j^T and P_{j-1} V_{j-1} back to back, then tile j's
   softmax (written to run while P.V is in flight, but ptxas places the P.V
   wait before its first shuffle). The operands come from quantize_qkv8.cu:
     * S = Q K^T on int8 codes (wgmma s8 x s8 -> s32, exact; K smoothed), then
       times q_scale[row or 64-row block] * k_scale[128-key tile] (the logit
       scale and log2 e are folded into q_scale); s32 -> f32 without I2F
       (q8_scores.cuh).
     * online softmax in f32, exp2 domain, and P.V in one of two schemes
       (F8_PV), each in its own header with the same functions:
         0 (pv_e4m3.cuh): P and V as FP8 E4M3, q_scale per 64 rows;
         1 (pv_u8.cuh): P as u8 codes per row and tile, V int8 about each
           channel's mid-range, q_scale per row: P.V exact in s32 per tile.
       Each tile's P.V and row sums start from 0 and are added to O and l in
       f32 registers, weighted and rescaled as the scheme says.

   Launch geometry (-D F8_D, F8_IN_KIND, F8_BQ, F8_BK, F8_STAGES, F8_THREADS,
   F8_SMEM_BYTES, F8_KEY_LENS, F8_PV from the host; static_asserts check them):
       grid  = (ceil(seq_q / 128), num_heads, batch)
       block = 384 threads = 3 warpgroups (producer, 2 consumers)
       dynamic shared memory = 1024 + (1 + 2 F8_STAGES) * 16384 + 1024 + 8 (1 + 4 F8_STAGES):
           Q, F8_STAGES x (K, V^T) tiles of 128 x 128 bytes in TMA's 128-byte
           swizzle, 8 x 128 bytes of ones, then the mbarriers (149,640 bytes at
           F8_STAGES = 4).
   Layout (one plane per batch and head, windows of rows offset by the host):
       q8, k8 : int8 [batch][num_heads][seq_q or seq_k][128] (tensor maps, box
                128 x 1 x 128 x 1; rows past the window zero-filled)
       vt8    : E4M3 (F8_PV 0) or int8 (1) [batch][num_heads][128][k_pad], keys
                permuted in 32-key chunks (q8_scores.cuh), k_pad = 128 * ceil(seq_k / 128),
                zero past seq_k
       q_scale: f32 [batch * num_heads][ceil(seq_q / 64)] (F8_PV 0) or [seq_q] (1)
       k_scale: f32 [batch * num_heads][k_pad / 128]
       v_scale: f32 [batch * num_heads][128] (F8_PV 0), or [2][128]: step, centre (1)
       q_shift: f32 [batch * num_heads][seq_q], scale log2(e) q . mu (log2 units): K smoothing took
                q . mu off every logit of the row; the log-sum-exp adds it back
       out    : token-major [batch, out_pitch, num_heads * 128], F8_IN_KIND
                (1 bfloat16, 2 float16)
       lse    : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null (F8_KEY_LENS=1 build only): batch b attends its
                first key_lens[b] keys (attention_io.cuh)
   Precision: int8 Q.K with per-row or per-block scales (exact products), f32
   softmax; P.V with E4M3's 3 mantissa bits, accumulated with the FP8 wgmma's
   ~14 bits within a tile (F8_PV 0), or exact on u8 P and int8 V (1); f32
   across tiles; the output rounded once to nearest even. Needs sm_90a. */

#include "attention_io.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_wgmma.cuh"

#if !defined(F8_D) || !defined(F8_IN_KIND) || !defined(F8_BQ) || !defined(F8_BK) || !defined(F8_STAGES) \
    || !defined(F8_THREADS) || !defined(F8_SMEM_BYTES) || !defined(F8_KEY_LENS) || !defined(F8_PV)
#error "flash_attn_fp8.cu needs -D F8_D, F8_IN_KIND, F8_BQ, F8_BK, F8_STAGES, F8_THREADS, F8_SMEM_BYTES, F8_KEY_LENS, F8_PV"
#endif
#if F8_PV == 0
#include "pv_e4m3.cuh"
#define F8_Q_ROWS 64                         /* query rows per q scale */
#define F8_V_SCALES 128                      /* v_scale floats per plane */
#elif F8_PV == 1
#include "pv_u8.cuh"
#define F8_Q_ROWS 1
#define F8_V_SCALES 256
#else
#error "F8_PV (the P.V scheme) must be 0 (E4M3) or 1 (u8 x int8)"
#endif
#if F8_D != 128 || F8_BQ != 128 || F8_BK != 128 || F8_THREADS != PK_THREADS
#error "the 8-bit kernel is written for head_dim 128, 128 x 128 tiles and 384 threads"
#endif
#if F8_IN_KIND != 1 && F8_IN_KIND != 2
#error "F8_IN_KIND (the output dtype) must be 1 (bfloat16) or 2 (float16)"
#endif

#define F8_TILE_BYTES (128 * 128)
#define F8_ONES_BYTES 1024                   /* 8 rows of 128 ones: B of the row-sum wgmma */
static_assert(F8_SMEM_BYTES == 1024 + (1 + 2 * F8_STAGES) * F8_TILE_BYTES + F8_ONES_BYTES + 8 * (1 + 4 * F8_STAGES),
              "F8_SMEM_BYTES disagrees with the kernel's Q | K stages | V^T stages | ones | mbarriers");
static_assert(F8_SMEM_BYTES <= 227 * 1024, "F8_SMEM_BYTES exceeds sm_90's 227 KiB per block");

__device__ __forceinline__ void f8_copy_tile(unsigned int dst, const pk_tensor_map* map, int column, int row,
                                             int head, int batch, unsigned int bar)
{
    pk_bar_expect_bytes(bar, F8_TILE_BYTES);
    pk_copy_box(dst, map, column, head, row, batch, bar);
}

/* S = Q K^T for one warpgroup: 4 k-steps of 32 bytes in one 128-byte slab. */
__device__ __forceinline__ void f8_issue_qk(int* s, unsigned int q_rows, unsigned int k_tile)
{
    const unsigned long long a = pk_wgmma_desc(q_rows, 16, 1024), b = pk_wgmma_desc(k_tile, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < F8_D / 32; kk++) {
        pk_wgmma_n128_s8_ss(s, pk_desc_advance(a, kk * 32), pk_desc_advance(b, kk * 32), kk > 0);
    }
    pk_wgmma_commit();
}

struct f8_smem : pk_ring<F8_STAGES> {
    unsigned int base;
    __device__ unsigned int q() const { return base; }
    __device__ unsigned int k(unsigned int s) const { return base + (1 + s) * F8_TILE_BYTES; }
    __device__ unsigned int v(unsigned int s) const { return base + (1 + F8_STAGES + s) * F8_TILE_BYTES; }
    __device__ unsigned int ones() const { return base + (1 + 2 * F8_STAGES) * F8_TILE_BYTES; }
};

/* The ones block (F8_PV_ONE: 1.0 in every byte, so its swizzle is moot), written once by threads 0..63 and
   made visible to the tensor cores' async proxy; the __syncthreads of the ring's init orders it before any
   wgmma. */
__device__ __forceinline__ void f8_fill_ones(const f8_smem& m)
{
    if (threadIdx.x < F8_ONES_BYTES / 16) {
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(m.ones() + 16 * threadIdx.x), "r"(F8_PV_ONE)
                     : "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
}

__device__ __forceinline__ void f8_produce(const f8_smem& m, const pk_tensor_map* tm_q, const pk_tensor_map* tm_k,
                                           const pk_tensor_map* tm_vt, int head, int batch, int q0,
                                           unsigned int n_tiles)
{
    f8_copy_tile(m.q(), tm_q, 0, q0, head, batch, m.q_full());
    m.produce(
        n_tiles,
        [&](unsigned int j, unsigned int s) { f8_copy_tile(m.k(s), tm_k, 0, j * F8_BK, head, batch, m.k_full(s)); },
        [&](unsigned int j, unsigned int s) { f8_copy_tile(m.v(s), tm_vt, j * F8_BK, 0, head, batch, m.v_full(s)); });
}

/* What f8_tile needs of its thread's rows: Q's shared address, the two rows' q scales, the k scales,
   counts. */
struct f8_rows {
    unsigned int q_rows;
    float qs[2];
    const float* ks;
    unsigned int seq_k, t;
};

/* Tile j's S (s32 bit patterns in s) to P in s, by the scheme's softmax; step gets corr and the weight. */
__device__ __forceinline__ void f8_scores_to_p(float* s, const f8_rows& r, pk_q8_rows& rows, pk_q8_step& step,
                                               unsigned int j)
{
    const float factor[2] = {pk_q8_factor(r.qs[0], r.ks[j]), pk_q8_factor(r.qs[1], r.ks[j])};
    pk_q8_bias_scores(s, j * F8_BK, r.seq_k, r.t);
    f8_softmax(s, rows, step, factor);
}

/* Key tile j >= 1 of one consumer warpgroup: S_j = Q K_j^T and ot = P_{j-1} V_{j-1} (P from p) issued
   back to back, tile j's softmax (the P.V wait lands before it in SASS); then, P.V done, P_j packed into p
   and ot and lt promoted into O and l. One P buffer: with two (P_j packed while P.V still reads P_{j-1}),
   ot's 64 registers leave too few and ptxas spills; measured no faster. */
__device__ __forceinline__ void f8_tile(const f8_smem& m, const f8_rows& r, float* o, float* ot, float* s,
                                        unsigned int* p, pk_q8_rows& rows, unsigned int j)
{
    const unsigned int st = j % F8_STAGES, prev = (j - 1) % F8_STAGES;
    pk_q8_step step;
    float lt[4];   /* the first row-sum wgmma ignores it (scale-d 0) */
    m.wait_k(st, j);
    m.wait_v(prev, j - 1);
    pk_pin<64>(s);
    pk_pin<64>(o);                           /* the last tile's promotion (it reads ot) stays above the fence */
    pk_wgmma_fence();
    f8_issue_qk((int*)s, r.q_rows, m.k(st));
    f8_issue_pv(ot, lt, p, m.v(prev), m.ones());
    pk_wgmma_wait<1>();
    pk_pin<64>(s);
    m.free_k(st);
    f8_scores_to_p(s, r, rows, step, j);
    pk_wgmma_wait<0>();
    pk_pin<64>(ot);
    pk_pin<4>(lt);
    m.free_v(prev);
    f8_pack_p(p, s);
    f8_promote(o, ot, lt, rows, step);
}

/* The prepass's scales of one launch (see the header's layout). */
struct f8_scales {
    const float* q;
    const float* k;
    const float* v;
    const float* shift;
};

/* Rows g and g + 8 of this thread, normalised, to out (and their LSE); rows >= seq_q skipped. */
__device__ __forceinline__ void f8_store_rows(const float* o, const pk_q8_rows& rows, unsigned short* __restrict__ out,
                                              float* __restrict__ lse, const f8_scales& scales,
                                              unsigned long long plane, unsigned int row0, unsigned int num_heads,
                                              unsigned int seq_q, unsigned int out_pitch, unsigned int t)
{
    const float* vs = scales.v + plane * F8_V_SCALES + 2 * t;
    const unsigned long long inner = (unsigned long long)num_heads * F8_D;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const unsigned int row = row0 + 8 * r;
        if (row >= seq_q) continue;
        const float inv = 1.f / rows.l[r];
        const unsigned long long token = (unsigned long long)blockIdx.z * out_pitch + row;
        unsigned short* dst = out + token * inner + (unsigned long long)blockIdx.y * F8_D + 2 * t;
        if (t == 0 && lse != nullptr) {
            const float shift = scales.shift[plane * seq_q + row];
            pk_store_lse(lse, token * num_heads + blockIdx.y, rows.m[r] - F8_PV_LSE_LOG2 + shift, rows.l[r]);
        }
        #pragma unroll
        for (int n = 0; n < 16; n++) {
            pk_store2<F8_IN_KIND>(dst + 8 * n, f8_value(o[4 * n + 2 * r], inv, vs + 8 * n),
                                  f8_value(o[4 * n + 2 * r + 1], inv, vs + 8 * n + 1));
        }
    }
}

__device__ __forceinline__ void f8_consume(const f8_smem& m, unsigned short* __restrict__ out, float* __restrict__ lse,
                                           const f8_scales& scales, unsigned int num_heads, unsigned int seq_q,
                                           unsigned int seq_k, unsigned int out_pitch, unsigned int n_tiles,
                                           unsigned int k_tiles)
{
    const unsigned int c = threadIdx.x / 128 - 1;
    const unsigned int warp = (threadIdx.x / 32) & 3u;
    const unsigned int g = (threadIdx.x & 31u) >> 2;
    const unsigned int t = threadIdx.x & 3u;
    const unsigned long long plane = (unsigned long long)blockIdx.z * num_heads + blockIdx.y;
    const unsigned int row0 = blockIdx.x * F8_BQ + c * 64 + warp * 16 + g;
    const unsigned int q_pitch = (seq_q + F8_Q_ROWS - 1) / F8_Q_ROWS;
    f8_rows r = {m.q() + c * 64 * 128, {1.f, 1.f}, scales.k + plane * k_tiles, seq_k, t};
    if (row0 < seq_q) r.qs[0] = scales.q[plane * q_pitch + row0 / F8_Q_ROWS];   /* rows past seq_q: never stored */
    r.qs[1] = r.qs[0];                                                      /* rows g, g + 8: one 64-row block */
    if (F8_Q_ROWS == 1 && row0 + 8 < seq_q) r.qs[1] = scales.q[plane * q_pitch + row0 + 8];

    float o[64], ot[64], s[64], lt[4];   /* ot, lt: no initial values (each tile's first wgmma: scale-d 0) */
    unsigned int p[16];
    pk_q8_rows rows = {{PK_NEG_INF, PK_NEG_INF}, {0.f, 0.f}, {1.f, 1.f}};
    pk_q8_step step;
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;

    m.wait_q();
    m.wait_k(0, 0);
    pk_wgmma_fence();
    f8_issue_qk((int*)s, r.q_rows, m.k(0));
    pk_wgmma_wait<0>();
    pk_pin<64>(s);
    m.free_k(0);
    f8_scores_to_p(s, r, rows, step, 0);
    rows.w[0] = step.w[0];
    rows.w[1] = step.w[1];
    f8_pack_p(p, s);

    for (unsigned int j = 1; j < n_tiles; j++) f8_tile(m, r, o, ot, s, p, rows, j);
    const unsigned int last = n_tiles - 1;
    m.wait_v(last % F8_STAGES, last);
    pk_pin<64>(o);
    pk_wgmma_fence();                        /* after the last writes of p, as wgmma's register operands need */
    f8_issue_pv(ot, lt, p, m.v(last % F8_STAGES), m.ones());
    pk_wgmma_wait<0>();
    pk_pin<64>(ot);
    pk_pin<4>(lt);
    f8_finish(o, ot, lt, rows);
    f8_store_rows(o, rows, out, lse, scales, plane, row0, num_heads, seq_q, out_pitch, t);
}

extern "C" __global__ void __launch_bounds__(F8_THREADS, 1)
joint_attention_fp8(
    PK_MAP_OPERANDS(unsigned short),    /* tm_v maps vt8, V^T */
    const float* __restrict__ q_scale,
    const float* __restrict__ k_scale,
    const float* __restrict__ v_scale,
    const float* __restrict__ q_shift,
    PK_MAP_SCALARS)
{
    extern __shared__ __align__(1024) unsigned char f8_smem_raw[];
    f8_smem m;
    m.base = pk_smem_base(f8_smem_raw);
    m.bars = m.ones() + F8_ONES_BYTES;
    f8_fill_ones(m);
    const unsigned int k_tiles = (seq_k + F8_BK - 1) / F8_BK;   /* the window's: k_scale's pitch */
#if F8_KEY_LENS
    if (pk_no_keys<F8_IN_KIND>(key_lens, seq_k, out, lse, F8_BQ, seq_q, num_heads, F8_D, out_pitch)) return;
#endif
    const unsigned int n_tiles = (seq_k + F8_BK - 1) / F8_BK;

    m.run(
        [&] {
            f8_produce(m, &tm_q, &tm_k, &tm_v, (int)blockIdx.y, (int)blockIdx.z, (int)(blockIdx.x * F8_BQ), n_tiles);
        },
        [&] {
            const f8_scales scales = {q_scale, k_scale, v_scale, q_shift};
            f8_consume(m, out, lse, scales, num_heads, seq_q, seq_k, out_pitch, n_tiles, k_tiles);
        });
}
