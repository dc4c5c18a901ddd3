/* fp16_split.cuh: f32 -> scaled float16 hi + lo, any architecture: the split of split_fp16x2.cu and of
   flash_attn_fp16x3.cu's probabilities, and the scale exponents both derive from a group's maximum.
     pk_split_exponent  the power-of-two scale of a group
     pk_split2_f16      two f32 values as float16 (hi, lo) pairs */

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

#endif
