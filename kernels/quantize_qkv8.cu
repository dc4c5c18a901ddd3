/* quantize_qkv8.cu: 16-bit q, k, v -> the 8-bit kernel's operands (pictor-diffusers).

   Algorithm (SageAttention2's scheme with the fixed choices of
   flash_attn_fp8.cu; QZ_PV picks the kernel's P.V scheme, 0 E4M3 or 1 u8 x int8):
     * q: int8, one absmax scale per 64 rows of a (batch, head) plane (QZ_PV 0)
       or per row (1); the logit scale times log2 e is folded into the stored scale;
     * k: smoothed (minus mu, a per-channel mean of the plane's keys: it
       shifts every logit of a row by -q . mu, which the softmax cancels and
       the log-sum-exp gets back from q_shift = scale log2(e) q . mu), then
       int8 with one absmax scale per 128-key tile;
     * v (QZ_PV 0): FP8 E4M3 with one scale per channel (its absmax over the
       plane's keys maps to 448); (QZ_PV 1): int8 about each channel's
       mid-range, round((v - centre) / step), centre = max / 2 + min / 2, step =
       (max / 2 - min / 2) / 127 (halves first: no f32 overflow); written
       transposed (V^T) with each 32-key chunk in the key order the 8-bit
       kernel's P registers have (q8_scores.cuh), zero past seq_k.
   Absmax values are floored at 2^-43, so an all-zero block gets a tiny
   normal scale (codes 0); a NaN input makes its block's or channel's scale NaN. With key counts (key_lens, batch b = plane / heads
   attends its first min(key_lens[b], seq_k) keys) only those keys enter mu,
   the maxima and the codes; later keys are zero in V^T (P is 0 there).
   Two launches of this entry, deterministic (fixed reduction order):
     phase 0: block (plane, chunk) sums k and takes max |v| (QZ_PV 0) or max v
              and max -v (1) of each channel over its share of the keys into
              partial[0 / 1 (/ 2)][plane][chunk][128];
     phase 1: block (plane, tile) reduces the partials (mu = sum / keys) and
              quantises query rows [128 tile, + 128) and key tile `tile`.

   Launch geometry (QZ_D, QZ_IN_KIND, QZ_THREADS, QZ_CHUNKS, QZ_PV from the host):
       phase 0 grid = (batch * num_heads, QZ_CHUNKS, 1)
       phase 1 grid = (batch * num_heads, max(ceil(seq_q / 128), ceil(seq_k / 128)), 1)
       block = QZ_THREADS = 256: thread i holds channels 8 (i % 16) .. + 7 of
       rows i / 16, + 16, ... (q: rows i % 128 / 16, + 8, ... of 64-row block i / 128)
       static shared memory: 33,824 (QZ_PV 0) or 34,336 (1) bytes: the staged v tile, mu, V's scales
       (448 / vmax; or step and centre), a reduction's scratch
   Layout (a window of rows: q, k, v offset to its first row; pitches are the
   full tensors' row counts, k_pad = 128 ceil(seq_k / 128)):
       q, k, v : 16-bit [batch * num_heads][q_pitch or kv_pitch][128]
       q8, k8  : int8 [batch * num_heads][seq_q or seq_k][128]
       vt8     : E4M3 (QZ_PV 0) or int8 (1) [batch * num_heads][128][k_pad]
       q_scale : f32 [batch * num_heads][ceil(seq_q / 64)] (QZ_PV 0) or [seq_q] (1)
       k_scale : f32 [batch * num_heads][k_pad / 128]
       v_scale : f32 [batch * num_heads][128] (QZ_PV 0) or [2][128]: step, centre (1)
       q_shift : f32 [batch * num_heads][seq_q] (log2 units)
       partial : f32 [2 + QZ_PV][batch * num_heads][QZ_CHUNKS][128]
       key_lens: [batch] i32 or null
   Precision: codes round to nearest (int8 ties to even, saturated at +-127;
   E4M3 satfinite); scales in f32. Needs sm_89+ (E4M3 conversion). */

#if !defined(QZ_D) || !defined(QZ_IN_KIND) || !defined(QZ_THREADS) || !defined(QZ_CHUNKS) || !defined(QZ_PV)
#error "quantize_qkv8.cu needs -D QZ_D, QZ_IN_KIND, QZ_THREADS, QZ_CHUNKS and QZ_PV from the host"
#endif
#if QZ_PV != 0 && QZ_PV != 1
#error "QZ_PV must be 0 (E4M3 P.V) or 1 (u8 x int8 P.V)"
#endif
#if QZ_D != 128 || QZ_THREADS != 256
#error "the 8-bit prepass is written for head_dim 128 and 256 threads"
#endif
#if QZ_IN_KIND != 1 && QZ_IN_KIND != 2
#error "QZ_IN_KIND must be 1 (bfloat16) or 2 (float16)"
#endif

#include "quant_rows.cuh"

#define QZ_TILE 128
#define QZ_STAT_ROWS 4   /* phase 0: rows per thread whose loads are in flight together */
#define QZ_FLOOR 1.1368683772161603e-13f   /* 2^-43 */
#define QZ_NEG_INF (-__int_as_float(0x7f800000))

#define QZ_STATS (2 + QZ_PV)   /* phase 0's statistics: sum k, max |v| (QZ_PV 0) or max v, max -v (1) */

/* Phase 0: the plane's chunk `blockIdx.y` of keys -> per-channel sum of k and max |v| (or max v, max -v;
   -inf over no keys). */
__device__ void qz_stats(const unsigned short* k, const unsigned short* v, float* partial, unsigned int keys,
                         unsigned int kv_pitch, float* red)
{
    const unsigned int plane = blockIdx.x, cg = threadIdx.x % 16, lane_row = threadIdx.x / 16;
    const unsigned int per = (keys + QZ_CHUNKS - 1) / QZ_CHUNKS;
    const unsigned int stop = min(keys, (blockIdx.y + 1) * per);
    float sum[8], vmax[8], vneg[8];
    #pragma unroll
    for (int e = 0; e < 8; e++) {
        sum[e] = 0.f;
        vmax[e] = QZ_PV ? QZ_NEG_INF : 0.f;
        vneg[e] = QZ_NEG_INF;
    }
    for (unsigned int base = blockIdx.y * per + lane_row; base < stop; base += 16 * QZ_STAT_ROWS) {
        uint4 k_rows[QZ_STAT_ROWS], v_rows[QZ_STAT_ROWS];   /* every load in flight before the first use */
        #pragma unroll
        for (int i = 0; i < QZ_STAT_ROWS; i++) {
            const unsigned int row = base + 16 * i;
            const unsigned long long at = ((unsigned long long)plane * kv_pitch + row) * QZ_D + 8 * cg;
            k_rows[i] = row < stop ? *(const uint4*)(k + at) : make_uint4(0u, 0u, 0u, 0u);
            v_rows[i] = row < stop ? *(const uint4*)(v + at) : make_uint4(0u, 0u, 0u, 0u);
        }
        #pragma unroll
        for (int i = 0; i < QZ_STAT_ROWS; i++) {   /* the thread's rows in increasing order; zero rows add 0 */
            float x[8];
            pk_unpack8<QZ_IN_KIND>(k_rows[i], x);
            #pragma unroll
            for (int e = 0; e < 8; e++) sum[e] += x[e];
            if (QZ_PV && base + 16 * i >= stop) continue;   /* a zero row would move max v and max -v */
            pk_unpack8<QZ_IN_KIND>(v_rows[i], x);
            #pragma unroll
            for (int e = 0; e < 8; e++) {
                vmax[e] = pk_max_nan(vmax[e], QZ_PV ? x[e] : fabsf(x[e]));
                vneg[e] = pk_max_nan(vneg[e], -x[e]);
            }
        }
    }
    const unsigned long long out = ((unsigned long long)plane * QZ_CHUNKS + blockIdx.y) * QZ_D;
    const unsigned long long second = (unsigned long long)gridDim.x * QZ_CHUNKS * QZ_D;
    for (int stat = 0; stat < QZ_STATS; stat++) {
        #pragma unroll
        for (int e = 0; e < 8; e++) red[lane_row * QZ_D + 8 * cg + e] = stat == 0 ? sum[e] : stat == 1 ? vmax[e] : vneg[e];
        __syncthreads();
        if (threadIdx.x < QZ_D) {
            float total = stat == 0 || !QZ_PV ? 0.f : QZ_NEG_INF;
            for (int r = 0; r < 16; r++) {
                const float x = red[r * QZ_D + threadIdx.x];
                total = stat == 0 ? total + x : pk_max_nan(total, x);
            }
            partial[stat * second + out + threadIdx.x] = total;
        }
        __syncthreads();
    }
}

/* q_shift of the thread's eight rows: scale_log2 (q_row . mu), summed over the 16 threads of a row (lanes
   sharing lane / 16); the thread holding channels 0-7 writes it (rows < count). */
__device__ __forceinline__ void qz_row_shift(const uint4* raw, const float* mu, float* shift_rows, unsigned int row0,
                                             unsigned int step, unsigned int count, unsigned int cg, float scale_log2)
{
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        float x[8], dot = 0.f;
        pk_unpack8<QZ_IN_KIND>(raw[u], x);
        #pragma unroll
        for (int e = 0; e < 8; e++) dot = fmaf(x[e], mu[8 * cg + e], dot);
        #pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        const unsigned int row = row0 + step * u;
        if (cg == 0 && row < count) shift_rows[row] = dot * scale_log2;
    }
}

/* The thread's eight rows' own scales (QZ_PV 1): each row's absmax over its 16 lanes (those sharing
   lane / 16), floored; the lane holding channels 0-7 writes absmax / 127 * scale_log2 (rows < count), and
   inv[u] gets 127 / absmax. */
__device__ __forceinline__ void qz_row_scales(const uint4* raw, float* scale_rows, unsigned int row0,
                                              unsigned int step, unsigned int count, unsigned int cg,
                                              float scale_log2, float* inv)
{
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        float x[8], amax = 0.f;
        pk_unpack8<QZ_IN_KIND>(raw[u], x);
        #pragma unroll
        for (int e = 0; e < 8; e++) amax = pk_max_nan(amax, fabsf(x[e]));
        #pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1) amax = pk_max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        amax = pk_max_nan(amax, QZ_FLOOR);
        const unsigned int row = row0 + step * u;
        if (cg == 0 && row < count) scale_rows[row] = amax / 127.f * scale_log2;
        inv[u] = 127.f / amax;
    }
}

/* Phase 1, q: rows [128 tile, + 128) as two 64-row blocks (threads 0-127 and 128-255), one scale per
   block (QZ_PV 0) or per row (1). */
__device__ void qz_query(const unsigned short* q, unsigned char* q8, float* q_scale, float* q_shift,
                         const float* mu, unsigned int seq_q, unsigned int q_pitch, float scale_log2, float* red)
{
    const unsigned int plane = blockIdx.x, half = threadIdx.x / 128, cg = threadIdx.x % 16;
    const unsigned int row0 = blockIdx.y * QZ_TILE + half * 64 + (threadIdx.x % 128) / 16;
    uint4 raw[8];
    float amax = pk_rows_absmax<QZ_D, QZ_IN_KIND>(q + (unsigned long long)plane * q_pitch * QZ_D, row0, 8, seq_q, cg, nullptr, raw);
    qz_row_shift(raw, mu, q_shift + (unsigned long long)plane * seq_q, row0, 8, seq_q, cg, scale_log2);
    float inv[8];
#if QZ_PV == 0
    amax = pk_max_nan(pk_block_max(amax, red, half * 128, 4), QZ_FLOOR);
    const unsigned int q_blocks = (seq_q + 63) / 64, block = blockIdx.y * 2 + half;
    if (block >= q_blocks) return;
    if (threadIdx.x % 128 == 0) q_scale[(unsigned long long)plane * q_blocks + block] = amax / 127.f * scale_log2;
    #pragma unroll
    for (int u = 0; u < 8; u++) inv[u] = 127.f / amax;
#else
    qz_row_scales(raw, q_scale + (unsigned long long)plane * seq_q, row0, 8, seq_q, cg, scale_log2, inv);
#endif
    pk_store_int8_rows<QZ_D, QZ_IN_KIND>(q8 + (unsigned long long)plane * seq_q * QZ_D, raw, row0, 8, seq_q, cg, nullptr, inv);
}

/* Phase 1, k: key tile `blockIdx.y`, smoothed by mu, one scale. */
__device__ void qz_key(const unsigned short* k, unsigned char* k8, float* k_scale, const float* mu, unsigned int seq_k,
                       unsigned int keys, unsigned int kv_pitch, float* red)
{
    const unsigned int plane = blockIdx.x, cg = threadIdx.x % 16;
    const unsigned int row0 = blockIdx.y * QZ_TILE + threadIdx.x / 16;
    uint4 raw[8];
    float amax = pk_rows_absmax<QZ_D, QZ_IN_KIND>(k + (unsigned long long)plane * kv_pitch * QZ_D, row0, 16, keys, cg, mu, raw);
    amax = pk_max_nan(pk_block_max(amax, red, 0, 8), QZ_FLOOR);
    const unsigned int k_tiles = (seq_k + QZ_TILE - 1) / QZ_TILE;
    if (threadIdx.x == 0) k_scale[(unsigned long long)plane * k_tiles + blockIdx.y] = amax / 127.f;
    float inv[8];
    #pragma unroll
    for (int u = 0; u < 8; u++) inv[u] = 127.f / amax;
    pk_store_int8_rows<QZ_D, QZ_IN_KIND>(k8 + (unsigned long long)plane * seq_k * QZ_D, raw, row0, 16, keys, cg, mu, inv);
}

/* Four values of one channel (keys key0 + e) as a word of 8-bit codes, byte e for key e: E4M3 of x * a
   (QZ_PV 0), or int8 round((x - b) / a) for keys < keys and 0 past them (1). */
__device__ __forceinline__ unsigned int qz_v_word(const float* x, float a, float b, const unsigned int* key,
                                                  unsigned int keys)
{
#if QZ_PV == 0
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x[1] * a), "f"(x[0] * a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x[3] * a), "f"(x[2] * a));
    return (unsigned int)lo | ((unsigned int)hi << 16);
#else
    unsigned int word = 0u;
    #pragma unroll
    for (int e = 0; e < 4; e++) {
        const int code = key[e] < keys ? max(-127, min(127, __float2int_rn((x[e] - b) / a))) : 0;
        word |= (unsigned int)(code & 0xff) << (8 * e);
    }
    return word;
#endif
}

/* Phase 1, v: key tile `blockIdx.y` as V^T rows of codes (channel-major, keys permuted; qz_v_word with
   va[d], vb[d]). The tile is staged in shared memory as it is (coalesced 16-byte loads, zero past seq_k);
   then thread i writes channel i % 128 of 32-key chunks 2 (i / 128) and + 1, reading down the staged
   columns (a warp reads 64 contiguous bytes). */
__device__ void qz_value_t(const unsigned short* v, unsigned char* vt8, const float* va, const float* vb,
                           unsigned int seq_k, unsigned int keys, unsigned int kv_pitch, unsigned short* stage)
{
    const unsigned int plane = blockIdx.x, cg = threadIdx.x % 16;
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        const unsigned int key = threadIdx.x / 16 + 16 * u, row = blockIdx.y * QZ_TILE + key;
        uint4 raw = make_uint4(0u, 0u, 0u, 0u);
        if (row < keys) raw = *(const uint4*)(v + ((unsigned long long)plane * kv_pitch + row) * QZ_D + 8 * cg);
        *(uint4*)(stage + key * QZ_D + 8 * cg) = raw;
    }
    __syncthreads();
    const unsigned int d = threadIdx.x % QZ_D, k_pad = (seq_k + QZ_TILE - 1) / QZ_TILE * QZ_TILE;
    const float a = va[d], b = vb[d];
    #pragma unroll
    for (int c = 0; c < 2; c++) {
        const unsigned int chunk = 32 * (2 * (threadIdx.x / QZ_D) + c);
        unsigned int words[8];
        #pragma unroll
        for (int w = 0; w < 8; w++) {
            float x[4];
            unsigned int key[4];
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const unsigned int logical = 4 * w + e;   /* = 16 h + 4 t + e' */
                key[e] = chunk + (logical & 16u) + 8 * ((logical >> 1) & 1u) + 2 * ((logical >> 2) & 3u)
                       + (logical & 1u);
                x[e] = pk_half_to_float<QZ_IN_KIND>(stage[key[e] * QZ_D + d]);
                key[e] += blockIdx.y * QZ_TILE;
            }
            words[w] = qz_v_word(x, a, b, key, keys);
        }
        uint4* dst = (uint4*)(vt8 + ((unsigned long long)plane * QZ_D + d) * k_pad + blockIdx.y * QZ_TILE + chunk);
        dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
        dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
    }
}

/* Channel d's V scales from phase 0's partials (stats 1 and 2 at `mine`, `mine + second`, chunk pitch
   QZ_D): va[d] = 448 / max |v| and v_scale[d] = max |v| / 448 (QZ_PV 0); va[d] = step, vb[d] = centre, and
   v_scale[0 / 1][d] the same (1; a plane without keys gets step 2^-43 / 127 and centre 0). */
__device__ __forceinline__ void qz_value_scales(const float* mine, unsigned long long second, float* v_scale,
                                                float* va, float* vb, unsigned int d)
{
    float top = QZ_PV ? QZ_NEG_INF : 0.f, bottom = QZ_NEG_INF;
    for (int c = 0; c < QZ_CHUNKS; c++) {
        top = pk_max_nan(top, mine[c * QZ_D]);
        if (QZ_PV) bottom = pk_max_nan(bottom, mine[second + c * QZ_D]);
    }
#if QZ_PV == 0
    const float vmax = pk_max_nan(top, QZ_FLOOR);
    va[d] = 448.f / vmax;
    if (blockIdx.y == 0) v_scale[(unsigned long long)blockIdx.x * QZ_D + d] = vmax / 448.f;
#else
    const bool none = top == QZ_NEG_INF;   /* no keys: max v = max -v = -inf */
    const float high = none ? 0.f : top / 2, low = none ? 0.f : -bottom / 2;
    va[d] = pk_max_nan(high - low, QZ_FLOOR) / 127.f;
    vb[d] = high + low;
    if (blockIdx.y == 0) {
        v_scale[(unsigned long long)blockIdx.x * 2 * QZ_D + d] = va[d];
        v_scale[(unsigned long long)blockIdx.x * 2 * QZ_D + QZ_D + d] = vb[d];
    }
#endif
}

extern "C" __global__ void __launch_bounds__(QZ_THREADS)
quantize_qkv8(
    const unsigned short* __restrict__ q,
    const unsigned short* __restrict__ k,
    const unsigned short* __restrict__ v,
    const int* __restrict__ key_lens,
    unsigned char* __restrict__ q8,
    unsigned char* __restrict__ k8,
    unsigned char* __restrict__ vt8,
    float* __restrict__ q_scale,
    float* __restrict__ k_scale,
    float* __restrict__ v_scale,
    float* __restrict__ q_shift,
    float* __restrict__ partial,
    unsigned int seq_q,
    unsigned int seq_k,
    unsigned int q_pitch,
    unsigned int kv_pitch,
    unsigned int num_heads,
    float scale_log2,
    unsigned int phase)
{
    __shared__ __align__(16) unsigned short stage[QZ_TILE * QZ_D];
    __shared__ float mu[QZ_D], va[QZ_D], vb[QZ_D], red[8];
    float* stats = (float*)stage;   /* phase 0: 16 x 128 floats */
    const unsigned int batch = blockIdx.x / num_heads;
    const unsigned int keys = key_lens == nullptr ? seq_k : (unsigned int)min(max(key_lens[batch], 0), (int)seq_k);
    if (phase == 0) {
        qz_stats(k, v, partial, keys, kv_pitch, stats);
        return;
    }
    const unsigned int d = threadIdx.x % QZ_D;
    const unsigned long long second = (unsigned long long)gridDim.x * QZ_CHUNKS * QZ_D;
    const float* mine = partial + (threadIdx.x / QZ_D) * second + (unsigned long long)blockIdx.x * QZ_CHUNKS * QZ_D + d;
    if (threadIdx.x < QZ_D) {
        float total = 0.f;
        for (int c = 0; c < QZ_CHUNKS; c++) total += mine[c * QZ_D];
        mu[d] = total / (float)max(keys, 1u);
    } else {
        qz_value_scales(mine, second, v_scale, va, vb, d);
    }
    __syncthreads();
    if (blockIdx.y * QZ_TILE < seq_q) qz_query(q, q8, q_scale, q_shift, mu, seq_q, q_pitch, scale_log2, red);
    if (blockIdx.y * QZ_TILE < seq_k) {
        qz_key(k, k8, k_scale, mu, seq_k, keys, kv_pitch, red);
        qz_value_t(v, vt8, va, vb, seq_k, keys, kv_pitch, stage);
    }
}
