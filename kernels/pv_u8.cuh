/* pv_u8.cuh: the 8-bit kernel's P.V on integers (flash_attn_fp8.cu with F8_PV 1).

   P is coded per row and 128-key tile against that tile's own maximum: code = round(255 * 2^(s - top)),
   a u8 (the tile's top key 255), made by one FFMA, the exp2 and a packing conversion of two floats to
   two u8 (cvt.pack.sat: nearest even, saturated; one F2IP). V is int8 about each channel's mid-range (step
   and centre per channel, from the prepass), so a tile's P.V is a u8 x s8 wgmma into s32, exact
   (|sum| <= 128 * 255 * 127 < 2^22), and so are the code sums l (an m64n8k32 wgmma against int8 ones).
   Each tile's products are weighted by w = 2^(top - m) when added to the f32 O and l: m, the row's
   reference max, moves only when a tile's top passes it by more than F8_SLACK = 8 (w <= 256), so O is
   rescaled on few tiles. s32 -> f32 by I2FP (one instruction, exact below 2^24).
   out = O * step[d] / l + centre[d].
   The FFMA's offset (top * factor - log2 255, top biased by 1.5 * 2^23) is rounded to f32, which scales a
   row's codes in the tile by 2^e, |e| <= ulp(offset) / 2 <= 0.75 factor log2 units, under one unit of the
   integer score: l scales alike, so only the tile's weight moves, by |e| ln 2; a top code rounded past
   255.5 saturates to 255. P's key order in registers and in V^T: q8_scores.cuh. */

#ifndef PICTOR_PV_U8_CUH
#define PICTOR_PV_U8_CUH

#include "q8_scores.cuh"
#include "sm90_wgmma.cuh"

#define F8_SLACK 8.f                    /* log2 units the reference max may lag a tile's top: w <= 256 */
#define F8_LOG2_U8 7.994353436858858f   /* log2(255) */
#define F8_PV_LSE_LOG2 F8_LOG2_U8       /* l sums codes of 255 * P: the LSE takes log2(255) off */
#define F8_PV_ONE 0x01010101u           /* four int8 ones: the row-sum wgmma's B */

/* One s32 product (its bit pattern in x) as f32, exactly (|x| < 2^22). */
__device__ __forceinline__ float f8_s32_value(float x)
{
    return __int2float_rn(__float_as_int(x));
}

/* ot = P V (4 k-steps of 32 (permuted) keys of the V^T tile) and lt = P's code sums, both s32 from 0:
   lt[0] (= lt[1]) is row g's sum, lt[2] (= lt[3]) row g + 8's. */
__device__ __forceinline__ void f8_issue_pv(float* ot, float* lt, const unsigned int* p, unsigned int vt_tile,
                                            unsigned int ones)
{
    const unsigned long long v = pk_wgmma_desc(vt_tile, 16, 1024), one = pk_wgmma_desc(ones, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        pk_wgmma_n128_u8s8_rs((int*)ot, p + 4 * kk, pk_desc_advance(v, kk * 32), kk > 0);
        pk_wgmma_n8_u8s8_rs((int*)lt, p + 4 * kk, pk_desc_advance(one, kk * 32), kk > 0);
    }
    pk_wgmma_commit();
}

/* Four floats to four u8 (x0 in the low byte), each rounded to nearest even and saturated to [0, 255]:
   cvt.pack puts b in byte 0, a in byte 1 and c's low half above them; ptxas makes each pair one F2IP. */
__device__ __forceinline__ unsigned int f8_u8x4(float x0, float x1, float x2, float x3)
{
    unsigned int high, word;
    asm("{\n.reg .s32 a, b;\n"
        "cvt.rni.s32.f32 a, %2;\ncvt.rni.s32.f32 b, %1;\ncvt.pack.sat.u8.s32.b32 %0, a, b, 0;\n}"
        : "=r"(high) : "f"(x2), "f"(x3));
    asm("{\n.reg .s32 a, b;\n"
        "cvt.rni.s32.f32 a, %2;\ncvt.rni.s32.f32 b, %1;\ncvt.pack.sat.u8.s32.b32 %0, a, b, %3;\n}"
        : "=r"(word) : "f"(x0), "f"(x1), "r"(high));
    return word;
}

/* The u8 codes of s's P in the A-fragment order (pk_q8_pack_p). */
__device__ __forceinline__ void f8_pack_p(unsigned int* p, const float* s)
{
    pk_q8_pack_p(p, s, f8_u8x4);
}

/* Tile j's softmax step on its biased scores s (pk_q8_bias_scores), leaving P = 255 * 2^(s - top) in s;
   factor[ri] is row ri's q scale times the tile's k scale. */
__device__ __forceinline__ void f8_softmax(float* s, pk_q8_rows& rows, pk_q8_step& step, const float* factor)
{
    #pragma unroll
    for (int ri = 0; ri < 2; ri++) {
        float* row = s + 2 * ri;
        const float top = pk_quad_max(pk_q8_row_max(row));
        const float m_tile = (top - PK_Q8_BIAS_F) * factor[ri];
        const bool moves = m_tile > rows.m[ri] + F8_SLACK;
        step.corr[ri] = moves ? pk_exp2(rows.m[ri] - m_tile) : 1.f;
        rows.m[ri] = moves ? m_tile : rows.m[ri];
        step.w[ri] = pk_exp2(m_tile - rows.m[ri]);
        const float offset = fmaf(top, factor[ri], -F8_LOG2_U8);
        #pragma unroll
        for (int n = 0; n < 16; n++) {
            row[4 * n] = pk_exp2(fmaf(row[4 * n], factor[ri], -offset));
            row[4 * n + 1] = pk_exp2(fmaf(row[4 * n + 1], factor[ri], -offset));
        }
    }
}

/* O = (O + w ot) * corr and l = (l + w lt) * corr in f32, w the promoted tile's weight; the multiplies by
   corr only when a row's reference max moved (a warp-uniform vote). Then the packed tile's weight. */
__device__ __forceinline__ void f8_promote(float* o, const float* ot, const float* lt, pk_q8_rows& rows,
                                           const pk_q8_step& step)
{
    rows.l[0] = fmaf(f8_s32_value(lt[0]), rows.w[0], rows.l[0]) * step.corr[0];
    rows.l[1] = fmaf(f8_s32_value(lt[2]), rows.w[1], rows.l[1]) * step.corr[1];
    if (__any_sync(0xffffffffu, step.corr[0] != 1.f || step.corr[1] != 1.f)) {
        #pragma unroll
        for (int i = 0; i < 64; i++) {
            o[i] = fmaf(f8_s32_value(ot[i]), rows.w[(i >> 1) & 1], o[i]) * step.corr[(i >> 1) & 1];
        }
    } else {
        #pragma unroll
        for (int i = 0; i < 64; i++) o[i] = fmaf(f8_s32_value(ot[i]), rows.w[(i >> 1) & 1], o[i]);
    }
    rows.w[0] = step.w[0];
    rows.w[1] = step.w[1];
}

/* The last tile's P.V and code sums added with its weight. */
__device__ __forceinline__ void f8_finish(float* o, const float* ot, const float* lt, pk_q8_rows& rows)
{
    rows.l[0] = fmaf(f8_s32_value(lt[0]), rows.w[0], rows.l[0]);
    rows.l[1] = fmaf(f8_s32_value(lt[2]), rows.w[1], rows.l[1]);
    #pragma unroll
    for (int i = 0; i < 64; i++) o[i] = fmaf(f8_s32_value(ot[i]), rows.w[(i >> 1) & 1], o[i]);
}

/* One output value from O's element, 1 / l and the channel's step (vs[0]) and centre (vs[128]). */
__device__ __forceinline__ float f8_value(float o, float inv, const float* vs)
{
    return fmaf(o * inv, vs[0], vs[128]);
}

#endif
