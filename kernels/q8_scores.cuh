/* q8_scores.cuh: the 8-bit kernel's scores (flash_attn_fp8.cu), shared by its two P.V schemes
   (pv_e4m3.cuh, pv_u8.cuh).

   S = Q K^T comes out of the int8 wgmma as s32 (|s| <= 128 * 127^2 < 2^22). It becomes f32 without I2F:
   the bit pattern s + 0x4B400000 is the f32 1.5 * 2^23 + s exactly, so every score is held biased by
   PK_Q8_BIAS_F, which the softmax removes inside its FFMA (or by one exact subtraction).
     pk_q8_bias_scores  s32 scores -> biased f32, keys past seq_k -> -inf
     pk_q8_row_max      the largest of one row's 32 scores in this thread's part of a 128-key tile
     pk_q8_factor       a row's logit factor (q scale times k scale), NaN kept
     pk_q8_rows         a consumer thread's two rows across the key tiles (running max, sum, weight)
     pk_q8_step         what one tile's softmax hands to the promotion of the previous tile's P.V
     pk_q8_pack_p       a tile's P as 8-bit codes in the A-fragment order of the P.V wgmma

   P's registers need no shuffle: S's accumulator holds, per thread and 32-key chunk, keys {2t, 2t+1,
   8+2t, 8+2t+1} (+16) of rows g and g+8, and the 8-bit A fragment wants logical keys 4t..4t+3 (+16) of
   the same rows; the prepass writes V^T with each 32-key chunk permuted the same way:
       logical L = 16 h + 4 t + e  <->  physical key 16 h + 8 (e >> 1) + 2 t + (e & 1). */

#ifndef PICTOR_Q8_SCORES_CUH
#define PICTOR_Q8_SCORES_CUH

#include "quant_rows.cuh"
#include "softmax.cuh"

#define PK_Q8_BIAS 0x4B400000
#define PK_Q8_BIAS_F 12582912.f   /* 1.5 * 2^23 */

/* A consumer thread's rows g and g + 8: m, the reference max (log2 units); l, the row sum of the tiles
   promoted so far; w, the weight of the tile whose P is packed (1 where P is coded against m itself). */
struct pk_q8_rows {
    float m[2], l[2], w[2];
};

/* One tile's softmax result: corr, the factor O and l take when m moves (else 1), and the tile's weight. */
struct pk_q8_step {
    float corr[2], w[2];
};

/* q_scale * k_scale, at least the smallest normal f32 (so a factor never flushes to 0: -inf * 0), NaN where
   a scale is NaN (a NaN input: the prepass's scales carry it, and max.NaN keeps it, where fmaxf would not). */
__device__ __forceinline__ float pk_q8_factor(float q_scale, float k_scale)
{
    return pk_max_nan(q_scale * k_scale, 1.17549435e-38f);
}

/* A tile's P (64 floats in the accumulator layout) as 8-bit codes in the A-fragment order: register
   4j + r of 32-key chunk j holds row g (r = 0, 2) or g + 8 (r = 1, 3) of n8 tiles 4j + (r >> 1) * 2 and the
   next, two keys each; pack4(x0, x1, x2, x3) makes one register of four codes, x0 in the low byte. */
template <typename Pack4>
__device__ __forceinline__ void pk_q8_pack_p(unsigned int* p, const float* s, Pack4 pack4)
{
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        #pragma unroll
        for (int r = 0; r < 4; r++) {
            const float* a = s + (4 * j + (r >> 1) * 2) * 4 + (r & 1) * 2;   /* n8 tile, row half */
            p[4 * j + r] = pack4(a[0], a[1], a[4], a[5]);
        }
    }
}

/* The 64 s32 scores of a 128-key tile (bit patterns in s) as biased f32; keys >= seq_k get -inf. */
__device__ __forceinline__ void pk_q8_bias_scores(float* s, unsigned int key0, unsigned int seq_k, unsigned int t)
{
    #pragma unroll
    for (int i = 0; i < 64; i++) s[i] = __int_as_float(__float_as_int(s[i]) + PK_Q8_BIAS);
    pk_mask_tail<16>(s, key0, seq_k, t);
}

/* The largest of one row's 32 scores (row = s + 2 ri) in this thread's part of the tile: four independent
   chains of four, so the dependent maxima are 6 deep instead of 16. */
__device__ __forceinline__ float pk_q8_row_max(const float* row)
{
    float a = fmaxf(row[0], row[1]), b = fmaxf(row[4], row[5]), c = fmaxf(row[8], row[9]), d = fmaxf(row[12], row[13]);
    #pragma unroll
    for (int n = 4; n < 16; n += 4) {
        a = fmaxf(a, fmaxf(row[4 * n], row[4 * n + 1]));
        b = fmaxf(b, fmaxf(row[4 * n + 4], row[4 * n + 5]));
        c = fmaxf(c, fmaxf(row[4 * n + 8], row[4 * n + 9]));
        d = fmaxf(d, fmaxf(row[4 * n + 12], row[4 * n + 13]));
    }
    return fmaxf(fmaxf(a, b), fmaxf(c, d));
}

#endif
