/* pv_e4m3.cuh: the 8-bit kernel's P.V on FP8 E4M3 (flash_attn_fp8.cu with F8_PV 0).

   P = 112 * 2^(s - m) (448 / 2^F8_SLACK folded into the exponent), rounded to E4M3 (satfinite); m, the
   row's reference maximum, moves only when a tile's maximum passes it by more than F8_SLACK, so P <= 448
   and O is rescaled on few tiles. Each tile's P.V sums from 0 in the FP8 wgmma's accumulator (~14
   significant bits over 128 keys) and is added to O in f32; l sums the rounded P by an m64n8k32 wgmma
   against a block of E4M3 ones. V is E4M3 with one scale per channel: out = O * v_scale[d] / l. P's key
   order in registers and in V^T: q8_scores.cuh. */

#ifndef PICTOR_PV_E4M3_CUH
#define PICTOR_PV_E4M3_CUH

#include "q8_scores.cuh"
#include "sm90_wgmma.cuh"

#define F8_SLACK 2.f                           /* log2 units the running max may lag the true one */
#define F8_LOG2_P (8.807354922057604f - F8_SLACK) /* log2(448) - slack: P = 2^(s - m + F8_LOG2_P) <= 448 */
#define F8_PV_LSE_LOG2 F8_LOG2_P               /* log2 of P's code scale, which the LSE takes off */
#define F8_PV_ONE 0x38383838u                  /* four E4M3 1.0 bytes: the row-sum wgmma's B */

/* Two floats to two E4M3 bytes (lo, hi), rounded to nearest, saturated at 448. */
__device__ __forceinline__ unsigned int f8_e4m3x2(float lo, float hi)
{
    unsigned short packed;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
    return packed;
}

/* ot = P V (4 k-steps of 32 (permuted) keys of the V^T tile) and lt = P's row sums, both from 0: lt[0]
   (= lt[1]) is row g's sum, lt[2] (= lt[3]) row g + 8's. */
__device__ __forceinline__ void f8_issue_pv(float* ot, float* lt, const unsigned int* p, unsigned int vt_tile,
                                            unsigned int ones)
{
    const unsigned long long v = pk_wgmma_desc(vt_tile, 16, 1024), one = pk_wgmma_desc(ones, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        pk_wgmma_n128_e4m3_rs(ot, p + 4 * kk, pk_desc_advance(v, kk * 32), kk > 0);
        pk_wgmma_n8_e4m3_rs(lt, p + 4 * kk, pk_desc_advance(one, kk * 32), kk > 0);
    }
    pk_wgmma_commit();
}

/* P as E4M3 in the A-fragment order (pk_q8_pack_p). */
__device__ __forceinline__ void f8_pack_p(unsigned int* p, const float* s)
{
    pk_q8_pack_p(p, s, [](float x0, float x1, float x2, float x3) {
        return f8_e4m3x2(x0, x1) | (f8_e4m3x2(x2, x3) << 16);
    });
}

/* Tile j's online-softmax step on its biased scores s (pk_q8_bias_scores), leaving P in s; factor[ri] is
   row ri's q scale times the tile's k scale. */
__device__ __forceinline__ void f8_softmax(float* s, pk_q8_rows& rows, pk_q8_step& step, const float* factor)
{
    #pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float* row = s + 2 * ri;
        const float m_tile = (pk_quad_max(pk_q8_row_max(row)) - PK_Q8_BIAS_F) * factor[ri];
        const bool moves = m_tile > rows.m[ri] + F8_SLACK;
        step.corr[ri] = moves ? pk_exp2(rows.m[ri] - m_tile) : 1.f;
        step.w[ri] = 1.f;
        rows.m[ri] = moves ? m_tile : rows.m[ri];
        const float offset = fmaf(PK_Q8_BIAS_F, factor[ri], rows.m[ri] - F8_LOG2_P);
        #pragma unroll
        for (int n = 0; n < 16; n++) {
            row[4 * n] = pk_exp2(fmaf(row[4 * n], factor[ri], -offset));
            row[4 * n + 1] = pk_exp2(fmaf(row[4 * n + 1], factor[ri], -offset));
        }
    }
}

/* O = (O + ot) * corr and l = (l + lt) * corr in f32; the multiplies only when a row's running max moved
   (a warp-uniform vote), which the lazy rescale makes rare. */
__device__ __forceinline__ void f8_promote(float* o, const float* ot, const float* lt, pk_q8_rows& rows,
                                           const pk_q8_step& step)
{
    rows.l[0] = (rows.l[0] + lt[0]) * step.corr[0];
    rows.l[1] = (rows.l[1] + lt[2]) * step.corr[1];
    if (__any_sync(0xffffffffu, step.corr[0] != 1.f || step.corr[1] != 1.f)) {
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] = (o[i] + ot[i]) * step.corr[(i >> 1) & 1];
    } else {
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] += ot[i];
    }
}

/* The last tile's P.V and row sums added, unscaled. */
__device__ __forceinline__ void f8_finish(float* o, const float* ot, const float* lt, pk_q8_rows& rows)
{
    rows.l[0] += lt[0];
    rows.l[1] += lt[2];
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] += ot[i];
}

/* One output value from O's element, 1 / l and the channel's scales (vs: the plane's v_scale + channel). */
__device__ __forceinline__ float f8_value(float o, float inv, const float* vs)
{
    return o * inv * vs[0];
}

#endif
