/* qkv_prologue.cu: FLUX.2 attention prologue in one launch (pictor-diffusers).

   Algorithm, per token and head, for q, k and v at once:
       q, k : RMSNorm over head_dim with the segment's weight (f32 math,
              y = x * rsqrt(mean(x^2) + eps) * w), then RoPE with diffusers'
              interleaved pairs: (y0, y1) -> (y0 c0 - y1 s0, y1 c1 + y0 s1)
       v    : copied
   and every result is written head-major in f32 or, for the 16-bit attention
   path, rounded once to the output dtype. Tokens come from
   two segments, joined in FLUX.2's [text, image] order: token n < text_len
   reads the text projections, the rest read the image projections (the
   single-stream blocks pass an empty text segment).

   Launch geometry (PR_D, PR_IN_KIND, PR_OUT_KIND and PR_THREADS come from the
   host as -D; a static_assert checks PR_THREADS against the 8 warps below):
       grid  = (seq, batch), block = PR_THREADS = 256 (8 warps)
       warp w handles the (tensor, head) items w, w+8, ... of 3 * num_heads;
       lane l holds dims 4l .. 4l+3 (lanes >= PR_D / 4 idle).
   Layout:
       inputs : [batch, tokens, ...] projections in the model dtype (PR_IN_KIND
                0: f32, 1: bf16, 2: f16, passed as raw bits), head h at column
                h * PR_D of each token row; row and batch strides in elements;
                rows 8-byte (16-bit) or 16-byte (f32) aligned
       weights: [PR_D] f32; cos, sin: [seq, PR_D] f32
       outputs: q head-major [batch, num_heads, seq, PR_D], k and v
                [batch, num_heads, seq + kv_gap, PR_D], in PR_OUT_KIND (0: f32,
                1: bf16, 2: f16, written as raw bits); k/v rows from token
                gap_at on move down by kv_gap, leaving rows [gap_at, gap_at +
                kv_gap) unwritten (FLUX.2's reference-image KV cache fills them)
   Precision: f32 throughout; RoPE's outputs are fma(y0, c0, -(y1 s0)) and fma(y1, c1, y0 s1), the
   products in brackets rounded (spelled out, not left to contraction); a 16-bit output is rounded once,
   to nearest even. */

#include "common.cuh"

#if !defined(PR_D) || !defined(PR_IN_KIND) || !defined(PR_OUT_KIND) || !defined(PR_THREADS)
#error "qkv_prologue.cu needs -D PR_D, PR_IN_KIND, PR_OUT_KIND and PR_THREADS from the host"
#endif
#if PR_D % 4 != 0 || PR_D > 128
#error "PR_D must be a multiple of 4, at most 128"
#endif
#if PR_IN_KIND < 0 || PR_IN_KIND > 2 || PR_OUT_KIND < 0 || PR_OUT_KIND > 2
#error "PR_IN_KIND and PR_OUT_KIND must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif

#define PR_WARPS 8
#define PR_LANES (PR_D / 4)
static_assert(PR_THREADS == PR_WARPS * 32, "PR_THREADS must be 256: the kernel runs 8 warps");

typedef pk_storage<PR_IN_KIND>::type pr_in_t;
typedef pk_storage<PR_OUT_KIND>::type pr_out_t;

#if PR_IN_KIND == 0
__device__ __forceinline__ float4 pr_load4(const pr_in_t* p) { return *(const float4*)p; }
#else
__device__ __forceinline__ float pr_to_f32(unsigned int bits16)
{
#if PR_IN_KIND == 1
    return __uint_as_float(bits16 << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)bits16));
    return f;
#endif
}
__device__ __forceinline__ float4 pr_load4(const pr_in_t* p)
{
    const uint2 raw = *(const uint2*)p;
    return make_float4(pr_to_f32(raw.x & 0xffffu), pr_to_f32(raw.x >> 16),
                       pr_to_f32(raw.y & 0xffffu), pr_to_f32(raw.y >> 16));
}
#endif

extern "C" __global__ void __launch_bounds__(PR_THREADS)
qkv_prologue(
    const pr_in_t* __restrict__ q_txt, const pr_in_t* __restrict__ k_txt, const pr_in_t* __restrict__ v_txt,
    const pr_in_t* __restrict__ q_img, const pr_in_t* __restrict__ k_img, const pr_in_t* __restrict__ v_img,
    const float* __restrict__ wq_txt, const float* __restrict__ wk_txt,
    const float* __restrict__ wq_img, const float* __restrict__ wk_img,
    const float* __restrict__ rope_cos, const float* __restrict__ rope_sin,
    pr_out_t* __restrict__ q_out, pr_out_t* __restrict__ k_out, pr_out_t* __restrict__ v_out,
    unsigned long long txt_row_stride, unsigned long long txt_batch_stride,
    unsigned long long img_row_stride, unsigned long long img_batch_stride,
    unsigned int text_len, unsigned int seq, unsigned int num_heads,
    unsigned int gap_at, unsigned int kv_gap,
    float eps_q, float eps_k, int has_rope)
{
    const unsigned int n = blockIdx.x;
    const unsigned int b = blockIdx.y;
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int d = 4u * lane;
    const bool text = n < text_len;
    const unsigned long long row = text
        ? b * txt_batch_stride + n * txt_row_stride
        : b * img_batch_stride + (n - text_len) * img_row_stride;

    float4 c = make_float4(1.f, 1.f, 1.f, 1.f);
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (has_rope && lane < PR_LANES) {
        c = *(const float4*)(rope_cos + (unsigned long long)n * PR_D + d);
        s = *(const float4*)(rope_sin + (unsigned long long)n * PR_D + d);
    }

    for (unsigned int item = threadIdx.x >> 5; item < 3u * num_heads; item += PR_WARPS) {
        const unsigned int tensor = item / num_heads;   /* 0: q, 1: k, 2: v (warp-uniform) */
        const unsigned int h = item % num_heads;
        const pr_in_t* src = tensor == 0 ? (text ? q_txt : q_img) : tensor == 1 ? (text ? k_txt : k_img)
                                                                                 : (text ? v_txt : v_img);
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (lane < PR_LANES) x = pr_load4(src + row + (unsigned long long)h * PR_D + d);
        if (tensor < 2) {
            const float* w = tensor == 0 ? (text ? wq_txt : wq_img) : (text ? wk_txt : wk_img);
            const float eps = tensor == 0 ? eps_q : eps_k;
            const float ss = pk_warp_sum(x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w);
            const float r = rsqrtf(ss / (float)PR_D + eps);
            if (lane < PR_LANES) {
                const float4 wv = *(const float4*)(w + d);
                const float4 y = make_float4(x.x * r * wv.x, x.y * r * wv.y, x.z * r * wv.z, x.w * r * wv.w);
                x = make_float4(__fmaf_rn(y.x, c.x, -__fmul_rn(y.y, s.x)),
                                __fmaf_rn(y.y, c.y, __fmul_rn(y.x, s.y)),
                                __fmaf_rn(y.z, c.z, -__fmul_rn(y.w, s.z)),
                                __fmaf_rn(y.w, c.w, __fmul_rn(y.z, s.w)));
            }
        }
        if (lane < PR_LANES) {
            pr_out_t* dst = tensor == 0 ? q_out : tensor == 1 ? k_out : v_out;
            const unsigned int gap = tensor == 0 ? 0u : kv_gap;
            const unsigned int out_row = n + (n >= gap_at ? gap : 0u);
            pk_store4<PR_OUT_KIND>(dst + (((unsigned long long)b * num_heads + h) * (seq + gap) + out_row) * PR_D + d, x);
        }
    }
}
