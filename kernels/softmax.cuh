/* softmax.cuh: the flash-attention online softmax on tensor-core accumulator tiles, any architecture.

   Used by the mma.sync kernels (flash_attn_mma16.cu, flash_attn_tf32x3.cu) and the wgmma kernels
   (flash_attn_wgmma.cu, flash_attn_fp16x3.cu; flash_attn_fp8.cu its tail mask):
     Softmax      pk_mask_tail, pk_online_softmax, pk_rescale
     LSE          pk_store_lse: the natural log-sum-exp of a row (optional output)

   Accumulator layout (mma.sync m16n8kX, and each warp's 16 rows of a wgmma
   m64nN): an n8 tile is four floats; c0, c1 are row g = lane / 4, columns
   2t, 2t + 1 (t = lane & 3), and c2, c3 the same columns of row g + 8. A
   thread's scores for MT m16 tiles of NT n8 tiles are one flat array
   s[(mt * NT + n) * 4 + c]; its row ri = 2 * mt + r is c = 2r, 2r + 1. */

#ifndef PICTOR_SOFTMAX_CUH
#define PICTOR_SOFTMAX_CUH

#include "common.cuh"

/* ---- online softmax on accumulator tiles ---- */

/* Keys >= seq get logit -inf. s: MT x NT tiles of scores whose first key is
   key0; a tile with every key valid (key0 + 8 * NT <= seq) is left as it is. */
template <int NT, int MT = 1>
__device__ __forceinline__ void pk_mask_tail(float* s, unsigned int key0, unsigned int seq, unsigned int t)
{
    if (key0 + 8 * NT > seq) {
        #pragma unroll
        for (int n = 0; n < NT; n++) {
            #pragma unroll
            for (int c = 0; c < 4; c++) {
                if (key0 + n * 8 + 2 * t + (c & 1) >= seq) {
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) s[(mt * NT + n) * 4 + c] = PK_NEG_INF;
                }
            }
        }
    }
}

/* One online-softmax step, in the exp2 domain, on MT x NT tiles of raw
   scores s, for the thread's 2 * MT rows ri (m_run: running max of
   scale_log2 * s; l_run: this thread's part of the running sum):
       m_new     = max(m_run, scale_log2 * max of the row over the tile and quad)
       corr[ri]  = 2^(m_run - m_new)
       s         = 2^(scale_log2 * s - m_new)
       l_run     = l_run * corr + sum of the thread's new s in the row
   Empty-row guard: m_run starts at -inf and every tile holds at least one
   valid key (pk_mask_tail leaves it finite), so m_new is finite and the
   first tile's corr is 2^-inf = 0 exactly, with no branch. EMPTY_ROWS: a
   tile may hold no finite score of a row (a key bias of -inf), so m_new may
   be -inf; the exponents then subtract 0 instead (weights 0, corr 0, l 0).
   FAST picks 2^x as in pk_exp2_by. */
template <int NT, int MT, bool FAST, bool EMPTY_ROWS = false>
__device__ __forceinline__ void pk_online_softmax(float* s, float* m_run, float* l_run, float* corr,
                                                  float scale_log2)
{
    #pragma unroll
    for (int ri = 0; ri < 2 * MT; ri++) {
        float* row = s + (ri >> 1) * NT * 4 + 2 * (ri & 1);
        float tile_max = PK_NEG_INF;
        #pragma unroll
        for (int n = 0; n < NT; n++) tile_max = fmaxf(tile_max, fmaxf(row[4 * n], row[4 * n + 1]));
        tile_max = pk_quad_max(tile_max);
        const float m_new = fmaxf(m_run[ri], tile_max * scale_log2);
        const float m_sub = EMPTY_ROWS && m_new == PK_NEG_INF ? 0.f : m_new;
        corr[ri] = pk_exp2_by<FAST>(m_run[ri] - m_sub);
        m_run[ri] = m_new;
        float row_sum = 0.f;
        #pragma unroll
        for (int n = 0; n < NT; n++) {
            row[4 * n] = pk_exp2_by<FAST>(fmaf(row[4 * n], scale_log2, -m_sub));
            row[4 * n + 1] = pk_exp2_by<FAST>(fmaf(row[4 * n + 1], scale_log2, -m_sub));
            row_sum += row[4 * n] + row[4 * n + 1];
        }
        l_run[ri] = l_run[ri] * corr[ri] + row_sum;
    }
}

/* o *= corr row-wise: MT x NT output tiles, corr from pk_online_softmax. */
template <int NT, int MT = 1>
__device__ __forceinline__ void pk_rescale(float* o, const float* corr)
{
    #pragma unroll
    for (int i = 0; i < MT * NT * 4; i++) o[i] *= corr[2 * (i / (NT * 4)) + ((i >> 1) & 1)];
}

/* ---- log-sum-exp output ---- */

/* lse[index] = ln(sum_j exp(scale * s_j)) of a row, from its final running max
   m (log2 units, scale applied) and running sum l >= 1: (m + log2 l) ln 2.
   Nothing is written when lse is null (the caller asked for no LSE). */
__device__ __forceinline__ void pk_store_lse(float* lse, unsigned long long index, float m_log2, float l)
{
    if (lse != nullptr) lse[index] = (m_log2 + log2f(l)) * 0.6931471805599453f;
}

#endif
