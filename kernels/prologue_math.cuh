/* prologue_math.cuh: the attention prologue's inputs and per-lane f32 math, any architecture: what
   qkv_prologue.cu and qkv_prologue_split.cu compute for one (token, tensor, head) before they store it,
   written once so that both compute the same bits.
     PK_PROLOGUE_INPUTS   the entries' projection, norm-weight and RoPE-table parameters
     PK_PROLOGUE_STRIDES  the projections' row and batch strides (elements)
     PK_PROLOGUE_GATHER   those parameters, text_len, eps_q, eps_k and has_rope as a pk_prologue
     pk_load4<KIND>       four projection values (0 f32, 1 bf16, 2 f16) as f32, through the read-only path
     pk_rotation_at<D>    a token's RoPE cos and sin on dims 4 lane .. 4 lane + 3 (identity without RoPE)
     pk_prologue_value    one (token, tensor, head)'s values on those dims: q and k through the RMSNorm
                          and RoPE, v as read
   Tokens come from two segments joined [text, image]: token n < text_len reads the text projections,
   the rest the image projections. Lane l holds dims 4l .. 4l + 3 of head_dim D (D % 4 == 0, D <= 128);
   lanes >= D / 4 hold zeros. Precision: f32 with every rounding spelled out (no contraction), so the
   result does not depend on the code around it: ss = fma(w, w, fma(z, z, fma(x, x, y y))) summed over
   the lanes, r = rsqrt(ss / D + eps), y = (x r) w, and RoPE's fma(y0, c0, -(y1 s0)), fma(y1, c1, y0 s1). */

#ifndef PICTOR_PROLOGUE_MATH_CUH
#define PICTOR_PROLOGUE_MATH_CUH

#include "common.cuh"

/* q, k, v text; q, k, v image (IN_T, raw bits for 16-bit kinds); the text and image q/k norm weights
   [D] f32; the RoPE tables cos, sin [seq, D] f32. */
#define PK_PROLOGUE_INPUTS(IN_T)                                                                          \
    const IN_T* __restrict__ q_txt, const IN_T* __restrict__ k_txt, const IN_T* __restrict__ v_txt,       \
        const IN_T* __restrict__ q_img, const IN_T* __restrict__ k_img, const IN_T* __restrict__ v_img,   \
        const float* __restrict__ wq_txt, const float* __restrict__ wk_txt,                               \
        const float* __restrict__ wq_img, const float* __restrict__ wk_img,                               \
        const float* __restrict__ rope_cos, const float* __restrict__ rope_sin
#define PK_PROLOGUE_STRIDES                                                                               \
    unsigned long long txt_row_stride, unsigned long long txt_batch_stride,                               \
        unsigned long long img_row_stride, unsigned long long img_batch_stride
#define PK_PROLOGUE_GATHER                                                                                \
    {q_txt, k_txt, v_txt, q_img, k_img, v_img, wq_txt, wk_txt, wq_img, wk_img, rope_cos, rope_sin,          \
     txt_row_stride, txt_batch_stride, img_row_stride, img_batch_stride, text_len, eps_q, eps_k, has_rope}

template <int KIND>
struct pk_prologue {
    typedef typename pk_storage<KIND>::type in_t;
    const in_t *q_txt, *k_txt, *v_txt, *q_img, *k_img, *v_img;
    const float *wq_txt, *wk_txt, *wq_img, *wk_img, *rope_cos, *rope_sin;
    unsigned long long txt_row, txt_batch, img_row, img_batch;
    unsigned int text_len;
    float eps_q, eps_k;
    int has_rope;
};

/* RoPE's cos and sin on a lane's four dims. */
struct pk_rotation {
    float4 c, s;
};

template <int KIND>
__device__ __forceinline__ float pk_half_to_f32(unsigned int bits16)
{
    static_assert(KIND == 1 || KIND == 2, "pk_half_to_f32: KIND 1 (bfloat16) or 2 (float16)");
    if constexpr (KIND == 1) {
        return __uint_as_float(bits16 << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)bits16));
        return f;
    }
}

/* p[0..3] as f32; p 16-byte (f32) or 8-byte (16-bit) aligned. */
template <int KIND>
__device__ __forceinline__ float4 pk_load4(const typename pk_storage<KIND>::type* p)
{
    if constexpr (KIND == 0) {
        return __ldg((const float4*)p);
    } else {
        const uint2 raw = __ldg((const uint2*)p);
        return make_float4(pk_half_to_f32<KIND>(raw.x & 0xffffu), pk_half_to_f32<KIND>(raw.x >> 16),
                           pk_half_to_f32<KIND>(raw.y & 0xffffu), pk_half_to_f32<KIND>(raw.y >> 16));
    }
}

/* Token n's cos and sin on dims 4 lane .. 4 lane + 3 (cos 1, sin 0 without RoPE or past D). */
template <int D, int KIND>
__device__ __forceinline__ pk_rotation pk_rotation_at(const pk_prologue<KIND>& in, unsigned int n, unsigned int lane)
{
    pk_rotation rot = {make_float4(1.f, 1.f, 1.f, 1.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    if (in.has_rope && lane < D / 4) {
        const unsigned long long at = (unsigned long long)n * D + 4 * lane;
        rot.c = __ldg((const float4*)(in.rope_cos + at));
        rot.s = __ldg((const float4*)(in.rope_sin + at));
    }
    return rot;
}

/* RMSNorm over the warp's D values with weight w and eps, then RoPE by rot. Warp-collective. */
template <int D>
__device__ __forceinline__ float4 pk_norm_rope(float4 x, const float* w, float eps, const pk_rotation& rot,
                                               unsigned int lane)
{
    const float ss = pk_warp_sum(__fmaf_rn(x.w, x.w, __fmaf_rn(x.z, x.z, __fmaf_rn(x.x, x.x, __fmul_rn(x.y, x.y)))));
    const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, (float)D), eps));
    if (lane >= D / 4) return x;
    const float4 wv = __ldg((const float4*)(w + 4 * lane));
    const float4 y = make_float4(__fmul_rn(__fmul_rn(x.x, r), wv.x), __fmul_rn(__fmul_rn(x.y, r), wv.y),
                                 __fmul_rn(__fmul_rn(x.z, r), wv.z), __fmul_rn(__fmul_rn(x.w, r), wv.w));
    const float4 c = rot.c, s = rot.s;
    return make_float4(__fmaf_rn(y.x, c.x, -__fmul_rn(y.y, s.x)), __fmaf_rn(y.y, c.y, __fmul_rn(y.x, s.y)),
                       __fmaf_rn(y.z, c.z, -__fmul_rn(y.w, s.z)), __fmaf_rn(y.w, c.w, __fmul_rn(y.z, s.w)));
}

/* Dims 4 lane .. 4 lane + 3 of head h of `tensor` (0 q, 1 k, 2 v; warp-uniform) at token n of batch b:
   q and k normed and rotated by rot (token n's), v as read. Warp-collective for q and k. */
template <int D, int KIND>
__device__ __forceinline__ float4 pk_prologue_value(const pk_prologue<KIND>& in, unsigned int n, unsigned int b,
                                                    unsigned int tensor, unsigned int h, const pk_rotation& rot,
                                                    unsigned int lane)
{
    const bool text = n < in.text_len;
    const unsigned long long row =
        text ? b * in.txt_batch + n * in.txt_row : b * in.img_batch + (n - in.text_len) * in.img_row;
    const typename pk_prologue<KIND>::in_t* src = tensor == 0   ? (text ? in.q_txt : in.q_img)
                                                  : tensor == 1 ? (text ? in.k_txt : in.k_img)
                                                                : (text ? in.v_txt : in.v_img);
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lane < D / 4) x = pk_load4<KIND>(src + row + (unsigned long long)h * D + 4 * lane);
    if (tensor == 2) return x;
    const float* w = tensor == 0 ? (text ? in.wq_txt : in.wq_img) : (text ? in.wk_txt : in.wk_img);
    return pk_norm_rope<D>(x, w, tensor == 0 ? in.eps_q : in.eps_k, rot, lane);
}

#endif
