/* flash_attn_fp16x3.cu: f32-accurate joint attention on Hopper fp16 tensor cores (pictor-diffusers).

   Algorithm: flash-attention forward, non-causal, no mask, online softmax in
   the exp2 domain, f32 softmax state, on operands split into float16 hi + lo
   planes (split_fp16x2.cu: x 2^e = hi + lo, 22 significant bits). Each
   product keeps three of the four partial products (Ootomo & Yokota 2022):
       S  = Qh Kl + Ql Kh + Qh Kh         (lo * lo, ~2^-22 relative, dropped)
       PV = Ph Vl + Pl Vh + Ph Vh         (P = 2^8 p split the same way)
   The tensor cores accumulate with truncation, so no accumulator runs long:
   S is two m64n64 accumulators (the correction products and the first half
   of Qh Kh in one, the second half of Qh Kh in the other) added in f32, and
   each key tile's P.V is a fresh accumulator (corrections first, while it is
   small) folded into O with one IEEE FFMA per element: O = O corr + PV.
   Scales: q and k carry 2^eq, 2^ek per (batch, head), folded into the logit
   factor scale_log2 2^-(eq + ek); v carries 2^ev[d] per channel, and p 2^8,
   both undone on the output. Warp-specialised like flash_attn_wgmma.cu, on
   sm90_pipeline.cuh and sm90_wgmma.cuh: a producer warpgroup (one thread) issues
   TMA copies into a two-stage ring of K and V tiles; two consumer warpgroups own
   64 query rows each.

   Launch geometry (X3_D, X3_OUT_KIND, X3_BQ, X3_BK, X3_STAGES, X3_THREADS and
   X3_SMEM_BYTES come from the host as -D; static_asserts check them):
       grid  = (ceil(seq_q / X3_BQ), num_heads, batch), X3_BQ = 128 query rows
       block = X3_THREADS = 384 = 3 warpgroups (producer, 2 consumers)
       dynamic shared memory = X3_SMEM_BYTES = 197,704 bytes at X3_STAGES = 2:
           Q hi and lo (128 x 128 each), X3_STAGES x (K hi, K lo, V hi, V lo,
           64 x 128 each), all 16-bit in two 64-column slabs of 128-byte rows
           (TMA's 128-byte swizzle); 1 KiB alignment slack; the mbarriers.
   Matrix products: wgmma.mma_async, f16 inputs, f32 accumulators.
       S : m64n64k16, A = Q slab rows, B = K slab rows (both K-major, shared)
       PV: m64n128k16, A = P from registers (S's accumulator layout, packed
           pairwise), B = V read transposed (MN-major; slabs LBO apart)
   Layout:
       planes  : float16 from the split, [2][batch * num_heads][rows][128]
                 per tensor (rows: seq_q for q, seq_k for k and v), as three
                 rank-4 tensor maps (dims 128, 2 * batch * num_heads planes, hi
                 planes first, rows, 1; box 64 x 1 x 64 x 1)
       colmax  : [3][batch * num_heads][128] u32 from the split (the scales)
       out     : token-major [batch, out_pitch, num_heads * 128] in X3_OUT_KIND
                 (0: f32, 1: bf16, 2: f16), offset by the host to the window's
                 first row
       lse     : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null, read by the X3_KEY_LENS=1 build only:
                 batch b attends its first key_lens[b] keys (attention_io.cuh)
   Precision: about 2^-22 relative per product term, f32 softmax, IEEE
   accumulation across key tiles; the output rounds once. Needs sm_90a. */

#include "attention_io.cuh"
#include "fp16_split.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_wgmma.cuh"
#include "softmax.cuh"

#if !defined(X3_D) || !defined(X3_OUT_KIND) || !defined(X3_BQ) || !defined(X3_BK) || !defined(X3_STAGES) \
    || !defined(X3_THREADS) || !defined(X3_SMEM_BYTES)
#error "flash_attn_fp16x3.cu needs -D X3_D, X3_OUT_KIND, X3_BQ, X3_BK, X3_STAGES, X3_THREADS, X3_SMEM_BYTES"
#endif
#if !defined(X3_KEY_LENS)
#error "flash_attn_fp16x3.cu needs -D X3_KEY_LENS=0 or 1 from the host"
#endif
#if X3_D != 128
#error "the fp16x3 kernel is built for head_dim 128 only"
#endif

#define X3_Q_SLAB (128 * 128)              /* 128 rows x 64 columns x 2 bytes */
#define X3_Q_PLANE (2 * X3_Q_SLAB)         /* one plane of the Q tile */
#define X3_KV_SLAB (64 * 128)              /* 64 rows x 64 columns x 2 bytes */
#define X3_KV_PLANE (2 * X3_KV_SLAB)       /* one plane of a K or V tile */
#define X3_STAGE_BYTES (4 * X3_KV_PLANE)   /* K hi, K lo, V hi, V lo */
#define X3_BARRIER_BYTES (8 * (1 + 4 * X3_STAGES))
#define X3_P_SCALE 256.f                   /* p in (0, 1] is split as 2^8 p: lo stays normal */
static_assert(X3_BQ == 128 && X3_BK == 64, "X3_BQ must be 128 and X3_BK 64: the kernel's tile shapes");
static_assert(X3_THREADS == PK_THREADS, "X3_THREADS must be 384: producer + 2 consumers");
static_assert(X3_STAGES >= 1, "X3_STAGES: at least one K/V stage");
static_assert(X3_SMEM_BYTES == 1024 + 2 * X3_Q_PLANE + X3_STAGES * X3_STAGE_BYTES + X3_BARRIER_BYTES,
              "X3_SMEM_BYTES disagrees with the kernel's Q | stages | mbarriers");
static_assert(X3_SMEM_BYTES <= 227 * 1024, "X3_SMEM_BYTES exceeds sm_90's 227 KiB per block");

/* Shared-memory map: Q hi, Q lo, then per stage K hi, K lo, V hi, V lo (1024-byte
   aligned for the swizzle), then the mbarriers q_full, k_full[], v_full[],
   k_free[], v_free[]. Plane 0 is hi, 1 is lo. */
struct x3_smem : pk_ring<X3_STAGES> {
    unsigned int base;
    __device__ unsigned int q(unsigned int plane) const { return base + plane * X3_Q_PLANE; }
    __device__ unsigned int k(unsigned int s, unsigned int plane) const
    {
        return base + 2 * X3_Q_PLANE + s * X3_STAGE_BYTES + plane * X3_KV_PLANE;
    }
    __device__ unsigned int v(unsigned int s, unsigned int plane) const { return k(s, plane) + 2 * X3_KV_PLANE; }
};

__device__ __forceinline__ x3_smem x3_carve(unsigned char* raw)
{
    x3_smem m;
    m.base = pk_smem_base(raw);
    m.bars = m.base + 2 * X3_Q_PLANE + X3_STAGES * X3_STAGE_BYTES;
    return m;
}

/* Both planes of `boxes` 64-row boxes from `row` (two 64-column slabs each) into
   hi at dst and lo at dst + plane_bytes. Boxes wholly past seq_q are not copied:
   their rows only feed query rows that are never stored. */
__device__ __forceinline__ void x3_copy_planes(unsigned int dst, unsigned int plane_bytes, const pk_tensor_map* map,
                                               int row, unsigned int boxes, int hi_plane, int lo_plane,
                                               unsigned int bar)
{
    pk_bar_expect_bytes(bar, boxes * 4 * X3_KV_SLAB);
    for (unsigned int box = 0; box < boxes; box++) {
        #pragma unroll
        for (int plane = 0; plane < 2; plane++) {
            #pragma unroll
            for (int slab = 0; slab < 2; slab++) {
                pk_copy_box(dst + plane * plane_bytes + slab * (plane_bytes / 2) + box * X3_KV_SLAB, map, slab * 64,
                            plane ? lo_plane : hi_plane, row + 64 * (int)box, 0, bar);
            }
        }
    }
}

__device__ __forceinline__ void x3_produce(const x3_smem& m, const pk_tensor_map* tm_q, const pk_tensor_map* tm_k,
                                           const pk_tensor_map* tm_v, int head, int heads_total, unsigned int q0,
                                           unsigned int seq_q, unsigned int n_tiles)
{
    const int lo = heads_total + head;
    const unsigned int q_boxes = min(X3_BQ / 64, (seq_q - q0 + 63) / 64);
    x3_copy_planes(m.q(0), X3_Q_PLANE, tm_q, (int)q0, q_boxes, head, lo, m.q_full());
    m.produce(
        n_tiles,
        [&](unsigned int j, unsigned int s) {
            x3_copy_planes(m.k(s, 0), X3_KV_PLANE, tm_k, (int)(j * X3_BK), 1, head, lo, m.k_full(s));
        },
        [&](unsigned int j, unsigned int s) {
            x3_copy_planes(m.v(s, 0), X3_KV_PLANE, tm_v, (int)(j * X3_BK), 1, head, lo, m.v_full(s));
        });
}

/* S = Qh Kl + Ql Kh + Qh Kh[d < 64] in sa, Qh Kh[d >= 64] in sb: 8 k-steps of 16 per product. */
__device__ __forceinline__ void x3_issue_qk(float* sa, float* sb, const x3_smem& m, unsigned int rows0,
                                            unsigned int s)
{
    #pragma unroll
    for (int term = 0; term < 3; term++) {
        const unsigned int q_plane = term == 1 ? 1 : 0, k_plane = term == 0 ? 1 : 0;
        #pragma unroll
        for (int kk = 0; kk < X3_D / 16; kk++) {
            const unsigned long long a =
                pk_wgmma_desc(m.q(q_plane) + (kk / 4) * X3_Q_SLAB + rows0 * 128 + (kk % 4) * 32, 16, 1024);
            const unsigned long long b = pk_wgmma_desc(m.k(s, k_plane) + (kk / 4) * X3_KV_SLAB + (kk % 4) * 32, 16, 1024);
            if (term == 2 && kk >= 4) {
                pk_wgmma_n64_ss<2>(sb, a, b, kk > 4);
            } else {
                pk_wgmma_n64_ss<2>(sa, a, b, term > 0 || kk > 0);
            }
        }
    }
    pk_wgmma_commit();
}

/* PV = Ph Vl + Pl Vh + Ph Vh into a fresh accumulator: 4 k-steps of 16 keys per product. */
__device__ __forceinline__ void x3_issue_pv(float* pv, const unsigned int* ph, const unsigned int* pl,
                                            const x3_smem& m, unsigned int s)
{
    #pragma unroll
    for (int term = 0; term < 3; term++) {
        const unsigned int* p = term == 1 ? pl : ph;
        const unsigned int v_plane = term == 0 ? 1 : 0;
        #pragma unroll
        for (int kk = 0; kk < X3_BK / 16; kk++) {
            const unsigned long long b = pk_wgmma_desc(m.v(s, v_plane) + kk * 16 * 128, X3_KV_SLAB, 1024);
            pk_wgmma_n128_rs<2>(pv, p + 4 * kk, b, term > 0 || kk > 0);
        }
    }
    pk_wgmma_commit();
}

/* P (probabilities of the tile, S's accumulator layout) as hi and lo A fragments of 2^8 p. */
__device__ __forceinline__ void x3_split_p(unsigned int* ph, unsigned int* pl, const float* p)
{
    #pragma unroll
    for (int i = 0; i < 16; i++) {
        const uint2 split = pk_split2_f16(p[2 * i] * X3_P_SCALE, p[2 * i + 1] * X3_P_SCALE);
        ph[i] = split.x;
        pl[i] = split.y;
    }
}

/* The logit factor scale_log2 2^-(eq + ek) of this (batch, head), in every lane. */
__device__ __forceinline__ float x3_logit_factor(const unsigned int* colmax, unsigned int group, unsigned int groups,
                                                 float scale_log2)
{
    const unsigned int lane = threadIdx.x & 31u;
    int exponent = 0;
    #pragma unroll
    for (int tensor = 0; tensor < 2; tensor++) {
        const uint4 c = *(const uint4*)(colmax + (tensor * groups + group) * X3_D + 4 * lane);
        unsigned int mx = max(max(c.x, c.y), max(c.z, c.w));
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        exponent += pk_split_exponent(mx);
    }
    return ldexpf(scale_log2, -exponent);
}

__device__ __forceinline__ void x3_store(typename pk_storage<X3_OUT_KIND>::type* __restrict__ out,
                                         float* __restrict__ lse, const float* o, const float* m_run,
                                         const float* l_run, const unsigned int* colmax, unsigned int rows0,
                                         unsigned int num_heads, unsigned int seq_q, unsigned int out_pitch)
{
    const unsigned int group = blockIdx.z * num_heads + blockIdx.y, groups = gridDim.y * gridDim.z;
    const unsigned int warp = (threadIdx.x / 32) & 3u, g = (threadIdx.x & 31u) >> 2, t = threadIdx.x & 3u;
    const unsigned int* v_max = colmax + (2 * groups + group) * X3_D + 2 * t;
    const unsigned long long inner = (unsigned long long)num_heads * X3_D;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l = pk_quad_sum(l_run[r]);
        const unsigned int row = blockIdx.x * X3_BQ + rows0 + warp * 16 + g + 8 * r;
        if (row >= seq_q) continue;
        const float inv = 1.f / (X3_P_SCALE * l);  /* then 2^-ev[d] per column, after the product */
        const unsigned long long token = (unsigned long long)blockIdx.z * out_pitch + row;
        typename pk_storage<X3_OUT_KIND>::type* dst = out + token * inner + (unsigned long long)blockIdx.y * X3_D + 2 * t;
        if (t == 0) pk_store_lse(lse, token * num_heads + blockIdx.y, m_run[r], l);
        #pragma unroll
        for (int n = 0; n < 16; n++) {
            const float a = ldexpf(o[4 * n + 2 * r] * inv, -pk_split_exponent(v_max[8 * n]));
            const float b = ldexpf(o[4 * n + 2 * r + 1] * inv, -pk_split_exponent(v_max[8 * n + 1]));
            pk_store2<X3_OUT_KIND>(dst + 8 * n, a, b);
        }
    }
}

__device__ __forceinline__ void x3_consume(const x3_smem& m, typename pk_storage<X3_OUT_KIND>::type* __restrict__ out,
                                           float* __restrict__ lse, const unsigned int* __restrict__ colmax,
                                           unsigned int num_heads, unsigned int seq_q, unsigned int seq_k,
                                           unsigned int out_pitch, float scale_log2, unsigned int n_tiles)
{
    /* this warpgroup's first row in the tile; taken through a shuffle so that ptxas sees it warp-uniform and
       keeps the Q descriptors in uniform registers (measured 1-2.6% faster on the H200) */
    const unsigned int rows0 = __shfl_sync(0xffffffffu, threadIdx.x / 128 - 1, 0) * 64;
    const unsigned int t = threadIdx.x & 3u;
    const float factor =
        x3_logit_factor(colmax, blockIdx.z * num_heads + blockIdx.y, gridDim.y * gridDim.z, scale_log2);

    float o[64], pv[64], sa[32], sb[32], corr[2];
    unsigned int ph[16], pl[16];
    float m_run[2] = {PK_NEG_INF, PK_NEG_INF};
    float l_run[2] = {0.f, 0.f};
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;

    m.wait_q();
    for (unsigned int j = 0; j < n_tiles; j++) {
        const unsigned int s = j % X3_STAGES;
        m.wait_k(s, j);
        pk_wgmma_fence();
        x3_issue_qk(sa, sb, m, rows0, s);
        pk_wgmma_wait<0>();
        pk_pin<32>(sa);
        pk_pin<32>(sb);
        m.free_k(s);
        #pragma unroll
        for (int i = 0; i < 32; i++) sa[i] += sb[i];
        pk_mask_tail<X3_BK / 8>(sa, j * X3_BK, seq_k, t);
        pk_online_softmax<X3_BK / 8, 1, true>(sa, m_run, l_run, corr, factor);
        x3_split_p(ph, pl, sa);

        m.wait_v(s, j);
        pk_wgmma_fence();
        x3_issue_pv(pv, ph, pl, m, s);
        pk_wgmma_wait<0>();
        pk_pin<64>(pv);
        m.free_v(s);
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] = fmaf(o[i], corr[(i >> 1) & 1], pv[i]);
    }
    x3_store(out, lse, o, m_run, l_run, colmax, rows0, num_heads, seq_q, out_pitch);
}

extern "C" __global__ void __launch_bounds__(X3_THREADS, 1)
joint_attention_fp16x3(
    PK_MAP_OPERANDS(typename pk_storage<X3_OUT_KIND>::type),
    const unsigned int* __restrict__ colmax,
    PK_MAP_SCALARS,
    float scale_log2)
{
    extern __shared__ __align__(1024) unsigned char x3_smem_raw[];
    const x3_smem m = x3_carve(x3_smem_raw);
#if X3_KEY_LENS
    if (pk_no_keys<X3_OUT_KIND>(key_lens, seq_k, out, lse, X3_BQ, seq_q, num_heads, X3_D, out_pitch)) return;
#endif
    const unsigned int n_tiles = (seq_k + X3_BK - 1) / X3_BK;

    m.run(
        [&] {
            const int head = (int)(blockIdx.z * num_heads + blockIdx.y);
            x3_produce(m, &tm_q, &tm_k, &tm_v, head, (int)(gridDim.y * gridDim.z), blockIdx.x * X3_BQ, seq_q,
                       n_tiles);
        },
        [&] { x3_consume(m, out, lse, colmax, num_heads, seq_q, seq_k, out_pitch, scale_log2, n_tiles); });
}
