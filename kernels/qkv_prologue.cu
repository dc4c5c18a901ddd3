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
   Precision: f32 throughout, prologue_math.cuh's (shared with qkv_prologue_split.cu, every rounding
   spelled out, subnormals kept: no -ftz); RoPE's outputs are fma(y0, c0, -(y1 s0)) and
   fma(y1, c1, y0 s1), the products in brackets rounded; a 16-bit output is rounded once, to nearest
   even. */

#include "prologue_math.cuh"

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
static_assert(PR_THREADS == PR_WARPS * 32, "PR_THREADS must be 256: the kernel runs 8 warps");

typedef pk_storage<PR_IN_KIND>::type pr_in_t;
typedef pk_storage<PR_OUT_KIND>::type pr_out_t;

extern "C" __global__ void __launch_bounds__(PR_THREADS)
qkv_prologue(
    PK_PROLOGUE_INPUTS(pr_in_t),
    pr_out_t* __restrict__ q_out, pr_out_t* __restrict__ k_out, pr_out_t* __restrict__ v_out,
    PK_PROLOGUE_STRIDES,
    unsigned int text_len, unsigned int seq, unsigned int num_heads,
    unsigned int gap_at, unsigned int kv_gap,
    float eps_q, float eps_k, int has_rope)
{
    const pk_prologue<PR_IN_KIND> in = PK_PROLOGUE_GATHER;
    const unsigned int n = blockIdx.x;
    const unsigned int b = blockIdx.y;
    const unsigned int lane = threadIdx.x & 31u;
    const pk_rotation rot = pk_rotation_at<PR_D>(in, n, lane);

    for (unsigned int item = threadIdx.x >> 5; item < 3u * num_heads; item += PR_WARPS) {
        const unsigned int tensor = item / num_heads;   /* 0: q, 1: k, 2: v (warp-uniform) */
        const unsigned int h = item % num_heads;
        const float4 x = pk_prologue_value<PR_D>(in, n, b, tensor, h, rot, lane);
        if (lane < PR_D / 4) {
            pr_out_t* dst = tensor == 0 ? q_out : tensor == 1 ? k_out : v_out;
            const unsigned int gap = tensor == 0 ? 0u : kv_gap;
            const unsigned int out_row = n + (n >= gap_at ? gap : 0u);
            pk_store4<PR_OUT_KIND>(dst + (((unsigned long long)b * num_heads + h) * (seq + gap) + out_row) * PR_D + 4 * lane, x);
        }
    }
}
