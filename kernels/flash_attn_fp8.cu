/* flash_attn_fp8.cu: 8-bit joint attention on Hopper tensor cores (pictor-diffusers).

   Algorithm: flash-attention forward, non-causal (key padding in the
   F8_KEY_LENS=1 build), with flash_attn_wgmma.cu's warp-specialised schedule
   (on sm90_pipeline.cuh and sm90_wgmma.cuh):
   a TMA producer warpgroup, two consumer warpgroups of 64 query rows that
   issue S_j = Q K_j^T and P_{j-1} V_{j-1} back to back, then tile j's
   softmax (written to run while P.V is in flight, but ptxas places the P.V
   wait before its first shuffle). The operands come from quantize_qkv8.cu:
     * S = Q K^T on int8 codes (wgmma s8 x s8 -> s32, exact; K smoothed), then
       times q_scale[64-row block] * k_scale[128-key tile] (the logit scale
       and log2 e are folded into q_scale): one factor per warpgroup and tile.
       s32 -> f32 without I2F: int x + 0x4B400000 is the f32 1.5 * 2^23 + x
       exactly for |x| < 2^22 (|x| <= 128 * 127^2 here), and the bias is
       folded into the softmax's FFMA offset.
     * online softmax in f32, exp2 domain; P = 112 * 2^(s - m) (448 / 2^F8_SLACK
       folded into the exponent) rounded to FP8 E4M3 (satfinite). m, the row's
       reference maximum, moves only when a tile's maximum passes it by more
       than F8_SLACK = 2 (so P <= 448), which spares O's rescale on most tiles.
     * O += P V on FP8 E4M3 (wgmma e4m3 x e4m3 -> f32) in two levels: each
       tile's four k32 steps from 0 into a tile accumulator, which is added to
       O in f32 registers. The FP8 wgmma adds into its accumulator with ~14
       significant bits: O summed over all keys there came out 8% small at
       4608 keys and 26% at 16896 on V with a 5-sigma channel mean.
     * l: the row sums of the rounded P, by an m64n8k32 wgmma per k32 step
       against a block of ones, also from 0 every tile and added in f32.
       out = O * v_scale[d] / l.
   The P registers need no shuffle: S's accumulator holds, per thread and
   32-key chunk, keys {2t, 2t+1, 8+2t, 8+2t+1} (+16) of rows g and g+8, and
   the FP8 A fragment wants logical keys 4t..4t+3 (+16) of the same rows; the
   prepass writes V^T with each 32-key chunk permuted the same way:
       logical L = 16 h + 4 t + e  <->  physical key 16 h + 8 (e >> 1) + 2 t + (e & 1).

   Launch geometry (-D F8_D, F8_IN_KIND, F8_BQ, F8_BK, F8_STAGES, F8_THREADS,
   F8_SMEM_BYTES, F8_KEY_LENS from the host; static_asserts check them):
       grid  = (ceil(seq_q / 128), num_heads, batch)
       block = 384 threads = 3 warpgroups (producer, 2 consumers)
       dynamic shared memory = 1024 + (1 + 2 F8_STAGES) * 16384 + 1024 + 8 (1 + 4 F8_STAGES):
           Q, F8_STAGES x (K, V^T) tiles of 128 x 128 bytes in TMA's 128-byte
           swizzle, 8 x 128 E4M3 ones, then the mbarriers (149,640 bytes at
           F8_STAGES = 4).
   Layout (one plane per batch and head, windows of rows offset by the host):
       q8, k8 : int8 [batch][num_heads][seq_q or seq_k][128] (tensor maps, box
                128 x 1 x 128 x 1; rows past the window zero-filled)
       vt8    : E4M3 [batch][num_heads][128][k_pad], keys permuted in 32-key
                chunks, k_pad = 128 * ceil(seq_k / 128), zero past seq_k
       q_scale: f32 [batch * num_heads][ceil(seq_q / 64)]
       k_scale: f32 [batch * num_heads][k_pad / 128]
       v_scale: f32 [batch * num_heads][128]
       q_shift: f32 [batch * num_heads][seq_q], scale log2(e) q . mu (log2 units): K smoothing took
                q . mu off every logit of the row; the log-sum-exp adds it back
       out    : token-major [batch, out_pitch, num_heads * 128], F8_IN_KIND
                (1 bfloat16, 2 float16)
       lse    : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null (F8_KEY_LENS=1 build only): batch b attends its
                first key_lens[b] keys (attention_io.cuh)
   Precision: int8 Q.K with per-block scales (exact products), FP8 E4M3 P and
   V (3 mantissa bits), f32 softmax; P.V accumulated with the FP8 wgmma's ~14
   bits within a 128-key tile and in f32 across tiles; the output rounded once
   to nearest even. Needs sm_90a. */

#include "attention_io.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_wgmma.cuh"
#include "softmax.cuh"

#if !defined(F8_D) || !defined(F8_IN_KIND) || !defined(F8_BQ) || !defined(F8_BK) || !defined(F8_STAGES) \
    || !defined(F8_THREADS) || !defined(F8_SMEM_BYTES) || !defined(F8_KEY_LENS)
#error "flash_attn_fp8.cu needs -D F8_D, F8_IN_KIND, F8_BQ, F8_BK, F8_STAGES, F8_THREADS, F8_SMEM_BYTES, F8_KEY_LENS"
#endif
#if F8_D != 128 || F8_BQ != 128 || F8_BK != 128 || F8_THREADS != PK_THREADS
#error "the 8-bit kernel is written for head_dim 128, 128 x 128 tiles and 384 threads"
#endif
#if F8_IN_KIND != 1 && F8_IN_KIND != 2
#error "F8_IN_KIND (the output dtype) must be 1 (bfloat16) or 2 (float16)"
#endif

#define F8_TILE_BYTES (128 * 128)
#define F8_ONES_BYTES 1024                   /* 8 rows of 128 E4M3 ones: B of the row-sum wgmma */
#define F8_BIAS 0x4B400000
#define F8_BIAS_F 12582912.f
#define F8_LOG2_P_SCALE 8.807354922057604f   /* log2(448) */
#define F8_SLACK 2.f                         /* log2 units the running max may lag the true one */
#define F8_LOG2_P (F8_LOG2_P_SCALE - F8_SLACK) /* P = 2^(s - m + F8_LOG2_P) <= 448 */
#define F8_MIN_FACTOR 1.17549435e-38f        /* the smallest normal f32: a factor never flushes to 0 (-inf * 0) */
static_assert(F8_SMEM_BYTES == 1024 + (1 + 2 * F8_STAGES) * F8_TILE_BYTES + F8_ONES_BYTES + 8 * (1 + 4 * F8_STAGES),
              "F8_SMEM_BYTES disagrees with the kernel's Q | K stages | V^T stages | ones | mbarriers");
static_assert(F8_SMEM_BYTES <= 227 * 1024, "F8_SMEM_BYTES exceeds sm_90's 227 KiB per block");

/* Two floats to two E4M3 bytes (lo, hi), rounded to nearest, saturated at 448. */
__device__ __forceinline__ unsigned int f8_e4m3x2(float lo, float hi)
{
    unsigned short packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
}

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

/* ot = P V (4 k-steps of 32 (permuted) keys of the V^T tile) and lt = P's row sums, both from 0: a fresh
   sum per tile keeps the FP8 wgmma's short accumulation (~14 bits) to 128 terms; f8_promote adds them in f32.
   The row sums are P 1 against 8 columns of E4M3 ones in shared memory: lt[0] (= lt[1]) is row g's sum,
   lt[2] (= lt[3]) row g + 8's. */
__device__ __forceinline__ void f8_issue_pv(float* ot, float* lt, const unsigned int* p, unsigned int vt_tile,
                                            unsigned int ones)
{
    const unsigned long long v = pk_wgmma_desc(vt_tile, 16, 1024), one = pk_wgmma_desc(ones, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < F8_BK / 32; kk++) {
        pk_wgmma_n128_e4m3_rs(ot, p + 4 * kk, pk_desc_advance(v, kk * 32), kk > 0);
        pk_wgmma_n8_e4m3_rs(lt, p + 4 * kk, pk_desc_advance(one, kk * 32), kk > 0);
    }
    pk_wgmma_commit();
}

/* P (already times 448) as E4M3 in the A-fragment order: register 4j + r of 32-key chunk j
   holds row g (r = 0, 2) or g + 8 (r = 1, 3) of n8 tiles 4j + (r >> 1) * 2
   and the next, two keys each (see the header for the key permutation). */
__device__ __forceinline__ void f8_pack_p(unsigned int* p, const float* s)
{
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        #pragma unroll
        for (int r = 0; r < 4; r++) {
            const float* a = s + (4 * j + (r >> 1) * 2) * 4 + (r & 1) * 2;   /* n8 tile, row half */
            p[4 * j + r] = f8_e4m3x2(a[0], a[1]) | (f8_e4m3x2(a[4], a[5]) << 16);
        }
    }
}

struct f8_smem : pk_ring<F8_STAGES> {
    unsigned int base;
    __device__ unsigned int q() const { return base; }
    __device__ unsigned int k(unsigned int s) const { return base + (1 + s) * F8_TILE_BYTES; }
    __device__ unsigned int v(unsigned int s) const { return base + (1 + F8_STAGES + s) * F8_TILE_BYTES; }
    __device__ unsigned int ones() const { return base + (1 + 2 * F8_STAGES) * F8_TILE_BYTES; }
};

/* The ones block (E4M3 1.0 = 0x38 in every byte, so its swizzle is moot), written once by threads 0..63 and
   made visible to the tensor cores' async proxy; the __syncthreads of the ring's init orders it before any
   wgmma. */
__device__ __forceinline__ void f8_fill_ones(const f8_smem& m)
{
    if (threadIdx.x < F8_ONES_BYTES / 16) {
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" :: "r"(m.ones() + 16 * threadIdx.x), "r"(0x38383838u)
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

/* The largest of one row's 32 scores in this thread's part of the tile: four independent chains of
   four, so the dependent maxima are 6 deep instead of 16. */
__device__ __forceinline__ float f8_row_max(const float* row)
{
    float a = fmaxf(row[0], row[1]), b = fmaxf(row[4], row[5]), c = fmaxf(row[8], row[9]), d = fmaxf(row[12], row[13]);
    #pragma unroll
    for (int n = 4; n < F8_BK / 8; n += 4) {
        a = fmaxf(a, fmaxf(row[4 * n], row[4 * n + 1]));
        b = fmaxf(b, fmaxf(row[4 * n + 4], row[4 * n + 5]));
        c = fmaxf(c, fmaxf(row[4 * n + 8], row[4 * n + 9]));
        d = fmaxf(d, fmaxf(row[4 * n + 12], row[4 * n + 13]));
    }
    return fmaxf(fmaxf(a, b), fmaxf(c, d));
}

/* Tile j's online-softmax step on the s32 scores in s (bit patterns), leaving
   P = (448 / 2^F8_SLACK) * 2^(factor * s - m) in s: `factor` is this warpgroup's q scale times
   the tile's k scale; keys >= seq_k get P = 0. The I2F-free conversion (see the
   header) leaves 1.5 * 2^23 + s in each register, removed inside the FFMA.
   m, the row's reference maximum, moves only when the tile's maximum exceeds it by more than
   F8_SLACK (log2 units; always on the first tile, where m = -inf): P <= 448 still, and O and l are
   rescaled (corr != 1) only on those tiles. */
__device__ __forceinline__ void f8_softmax(float* s, float* m_run, float* corr, float factor,
                                           unsigned int key0, unsigned int seq_k, unsigned int t)
{
    #pragma unroll
    for (int i = 0; i < 64; i++) s[i] = __int_as_float(__float_as_int(s[i]) + F8_BIAS);
    pk_mask_tail<F8_BK / 8>(s, key0, seq_k, t);
    #pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float* row = s + 2 * ri;
        const float m_tile = (pk_quad_max(f8_row_max(row)) - F8_BIAS_F) * factor;
        const bool moves = m_tile > m_run[ri] + F8_SLACK;
        corr[ri] = moves ? pk_exp2(m_run[ri] - m_tile) : 1.f;
        m_run[ri] = moves ? m_tile : m_run[ri];
        const float offset = fmaf(F8_BIAS_F, factor, m_run[ri] - F8_LOG2_P);
        #pragma unroll
        for (int n = 0; n < F8_BK / 8; n++) {
            row[4 * n] = pk_exp2(fmaf(row[4 * n], factor, -offset));
            row[4 * n + 1] = pk_exp2(fmaf(row[4 * n + 1], factor, -offset));
        }
    }
}

/* What f8_tile needs of its warpgroup's rows: Q's shared address, the q scale, the k scales, counts. */
struct f8_rows {
    unsigned int q_rows;
    float qs;
    const float* ks;
    unsigned int seq_k, t;
};

/* O = (O + ot) * corr and l = (l + lt) * corr in f32: a tile's P.V and row sums promoted out of the FP8
   wgmma's accumulator; the multiplies only when a row's running max moved (a warp-uniform vote), which the
   lazy rescale makes rare. */
__device__ __forceinline__ void f8_promote(float* o, const float* ot, const float* lt, float* l_run,
                                           const float* corr)
{
    l_run[0] = (l_run[0] + lt[0]) * corr[0];
    l_run[1] = (l_run[1] + lt[2]) * corr[1];
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] = (o[i] + ot[i]) * corr[(i >> 1) & 1];
    } else {
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] += ot[i];
    }
}

/* Key tile j >= 1 of one consumer warpgroup: S_j = Q K_j^T and ot = P_{j-1} V_{j-1} (P from p) issued
   back to back, tile j's softmax (the P.V wait lands before it in SASS); then, P.V done, P_j packed into p
   and ot and lt promoted into O and l. One P buffer: with two (P_j packed while P.V still reads P_{j-1}),
   ot's 64 registers leave too few and ptxas spills; measured no faster. */
__device__ __forceinline__ void f8_tile(const f8_smem& m, const f8_rows& r, float* o, float* ot, float* s,
                                        unsigned int* p, float* m_run, float* l_run, unsigned int j)
{
    const unsigned int st = j % F8_STAGES, prev = (j - 1) % F8_STAGES;
    float corr[2], lt[4];   /* corr: f8_softmax writes it; lt: the first row-sum wgmma ignores it (scale-d 0) */
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
    f8_softmax(s, m_run, corr, fmaxf(r.qs * r.ks[j], F8_MIN_FACTOR), j * F8_BK, r.seq_k, r.t);
    pk_wgmma_wait<0>();
    pk_pin<64>(ot);
    pk_pin<4>(lt);
    m.free_v(prev);
    f8_pack_p(p, s);
    f8_promote(o, ot, lt, l_run, corr);
}

/* The prepass's per-block scales of one launch (see the header's layout). */
struct f8_scales {
    const float* q;
    const float* k;
    const float* v;
    const float* shift;
};

__device__ __forceinline__ void f8_consume(const f8_smem& m, unsigned short* __restrict__ out, float* __restrict__ lse,
                                           const f8_scales& scales, unsigned int num_heads, unsigned int seq_q,
                                           unsigned int seq_k, unsigned int out_pitch, unsigned int n_tiles,
                                           unsigned int k_tiles)
{
    const unsigned int c = threadIdx.x / 128 - 1;
    const unsigned int warp = (threadIdx.x / 32) & 3u;
    const unsigned int g = (threadIdx.x & 31u) >> 2;
    const unsigned int t = threadIdx.x & 3u;
    const unsigned int q_rows = m.q() + c * 64 * 128;
    const unsigned long long plane = (unsigned long long)blockIdx.z * num_heads + blockIdx.y;
    const unsigned int q_blocks = (seq_q + 63) / 64, q_block = blockIdx.x * 2 + c;
    const float qs = q_block < q_blocks ? scales.q[plane * q_blocks + q_block] : 1.f;   /* rows past seq_q: unused */
    const float* ks = scales.k + plane * k_tiles;

    float o[64], ot[64], s[64], corr[2], lt[4];   /* ot, lt: no initial values (each tile's first wgmma: scale-d 0) */
    unsigned int p[16];
    float m_run[2] = {PK_NEG_INF, PK_NEG_INF};
    float l_run[2] = {0.f, 0.f};   /* this row's sum of the rounded P over the tiles before the one in flight */
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] = 0.f;

    m.wait_q();
    m.wait_k(0, 0);
    pk_wgmma_fence();
    f8_issue_qk((int*)s, q_rows, m.k(0));
    pk_wgmma_wait<0>();
    pk_pin<64>(s);
    m.free_k(0);
    f8_softmax(s, m_run, corr, fmaxf(qs * ks[0], F8_MIN_FACTOR), 0, seq_k, t);
    f8_pack_p(p, s);

    const f8_rows rows = {q_rows, qs, ks, seq_k, t};
    for (unsigned int j = 1; j < n_tiles; j++) f8_tile(m, rows, o, ot, s, p, m_run, l_run, j);
    const unsigned int last = n_tiles - 1;
    m.wait_v(last % F8_STAGES, last);
    pk_pin<64>(o);
    pk_wgmma_fence();                        /* after the last writes of p, as wgmma's register operands need */
    f8_issue_pv(ot, lt, p, m.v(last % F8_STAGES), m.ones());
    pk_wgmma_wait<0>();
    pk_pin<64>(ot);
    pk_pin<4>(lt);
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] += ot[i];

    const float* vs = scales.v + plane * F8_D + 2 * t;
    const unsigned long long inner = (unsigned long long)num_heads * F8_D;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l = l_run[r] + lt[2 * r];
        const unsigned int row = blockIdx.x * F8_BQ + c * 64 + warp * 16 + g + 8 * r;
        if (row >= seq_q) continue;
        const float inv = 1.f / l;
        const unsigned long long token = (unsigned long long)blockIdx.z * out_pitch + row;
        unsigned short* dst = out + token * inner + (unsigned long long)blockIdx.y * F8_D + 2 * t;
        if (t == 0 && lse != nullptr) {
            const float shift = scales.shift[plane * seq_q + row];
            pk_store_lse(lse, token * num_heads + blockIdx.y, m_run[r] - F8_LOG2_P + shift, l);
        }
        #pragma unroll
        for (int n = 0; n < 16; n++) {
            pk_store2<F8_IN_KIND>(dst + 8 * n, o[4 * n + 2 * r] * inv * vs[8 * n],
                                  o[4 * n + 2 * r + 1] * inv * vs[8 * n + 1]);
        }
    }
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
