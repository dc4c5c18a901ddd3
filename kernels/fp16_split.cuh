/* fp16_split.cuh: f32 -> scaled float16 hi + lo, any architecture: the split of split_fp16x2.cu,
   qkv_prologue_split.cu and flash_attn_fp16x3.cu's probabilities, and the scale exponents all derive
   from a group's maximum.
     pk_split_exponent  the power-of-two scale of a group
     pk_split2_f16      two f32 values as float16 (hi, lo) pairs
     pk_abs_bits        |x| as an orderable bit pattern (column maxima by integer max)
     pk_split_scales    four columns' scales 2^e from a group's column maxima
     pk_split4_store    four f32 values times their scales, stored as hi and lo */

#ifndef PICTOR_FP16_SPLIT_CUH
#define PICTOR_FP16_SPLIT_CUH

#include "common.cuh"

#define PK_SPLIT_TOP 15       /* a scale group's largest |x| is scaled into [2^14, 2^15) */
#define PK_SPLIT_MAX_EXP 120  /* scale exponents are clamped to +-120: 2^e and 2^-e stay normal f32 */

/* The exponent e of the power-of-two scale 2^e for a group whose largest |x| has
   the f32 bit pattern `max_bits`: 0 for an all-zero or non-finite group (whose
   results are zero or non-finite anyway). */
__device__ __forceinline__ int pk_split_exponent(unsigned int max_bits)
{
    const float m = __uint_as_float(max_bits);
    if (m == 0.f || !(m <= 3.4028235e38f)) return 0;
    int e;
    frexpf(m, &e);  /* m = f 2^e, f in [0.5, 1) */
    return max(-PK_SPLIT_MAX_EXP, min(PK_SPLIT_MAX_EXP, PK_SPLIT_TOP - e));
}

/* (hi, lo) float16 pairs of two f32 values a, b (already scaled): hi rounds to
   nearest even, lo is the rounded remainder, so hi + lo keeps 22 bits. */
__device__ __forceinline__ uint2 pk_split2_f16(float a, float b)
{
    const unsigned int hi = pk_pack2<2>(a, b);
    float ha, hb;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(ha), "=f"(hb) : "r"(hi));
    return make_uint2(hi, pk_pack2<2>(a - ha, b - hb));
}

/* |x| as an orderable bit pattern: for non-negative floats unsigned order is numeric
   order, and a NaN's pattern sorts above inf. */
__device__ __forceinline__ unsigned int pk_abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

/* m with |x| folded in, column by column. */
__device__ __forceinline__ uint4 pk_abs_max4(uint4 m, float4 x)
{
    return make_uint4(max(m.x, pk_abs_bits(x.x)), max(m.y, pk_abs_bits(x.y)), max(m.z, pk_abs_bits(x.z)),
                      max(m.w, pk_abs_bits(x.w)));
}

/* The scales 2^e of columns 4 lane .. 4 lane + 3 of one 128-column group from its column maxima
   `group_max` (f32 bit patterns): per column (`per_column`, v), or the group's largest (q and k), in
   every lane. */
__device__ __forceinline__ float4 pk_split_scales(const unsigned int* group_max, bool per_column, unsigned int lane)
{
    const uint4 c = *(const uint4*)(group_max + 4 * lane);
    if (per_column) {
        return make_float4(ldexpf(1.f, pk_split_exponent(c.x)), ldexpf(1.f, pk_split_exponent(c.y)),
                           ldexpf(1.f, pk_split_exponent(c.z)), ldexpf(1.f, pk_split_exponent(c.w)));
    }
    unsigned int m = max(max(c.x, c.y), max(c.z, c.w));
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float s = ldexpf(1.f, pk_split_exponent(m));
    return make_float4(s, s, s, s);
}

/* x scale (exact: powers of two) split into float16 hi at `hi` and lo at `lo`, four each (8-byte aligned).
   The products are rounded before the split (__fmul_rn: never contracted into its subtraction). */
__device__ __forceinline__ void pk_split4_store(float4 x, float4 scale, unsigned short* hi, unsigned short* lo)
{
    const uint2 a = pk_split2_f16(__fmul_rn(x.x, scale.x), __fmul_rn(x.y, scale.y));
    const uint2 b = pk_split2_f16(__fmul_rn(x.z, scale.z), __fmul_rn(x.w, scale.w));
    *(uint2*)hi = make_uint2(a.x, b.x);
    *(uint2*)lo = make_uint2(a.y, b.y);
}

#endif
