/* qkv_prologue_split.cu: the parity path's prologue, writing the fp16x3 kernel's operands (pictor-diffusers).

   Algorithm: qkv_prologue.cu's f32 values, per token and head (prologue_math.cuh: q and k through the
   RMSNorm and RoPE, v as read), split as split_fp16x2.cu splits them (split_phases.cuh):
       x 2^e = hi + lo,  hi = fp16(x 2^e),  lo = fp16(x 2^e - hi)   (both round to nearest even)
   with e putting each group's largest |x| in [2^14, 2^15); groups: q and k one per (batch, head), v one
   per (batch, head, channel), so v channels of any magnitude keep their relative precision. Two
   launches of this entry: phase 0 computes the values and folds |x| of each column into colmax;
   phase 1 computes them again and writes the planes with the scales colmax gives. The f32 values, the
   maxima and the planes are bit for bit those of qkv_prologue.cu (f32 out) followed by
   split_fp16x2.cu, without the f32 q, k, v between them. No gap in k and v (FLUX.2's KV cache takes
   the two kernels).

   Launch geometry (PS_D, PS_IN_KIND, PS_ROWS and PS_THREADS come from the host as -D):
       grid  = (batch * num_heads, ceil(seq / PS_ROWS), 3 tensors q, k, v)
       block = PS_THREADS = 256 (8 warps); warp w takes tokens w, w + 8, ... of the block's PS_ROWS
       tokens; lane l holds dims 4l .. 4l + 3.
   Layout:
       inputs : qkv_prologue.cu's: [batch, tokens, ...] projections in the model dtype (PS_IN_KIND 0:
                f32, 1: bf16, 2: f16, as raw bits), head h at column h * 128 of each token row, row
                and batch strides in elements; norm weights [128] f32; cos, sin [seq, 128] f32
       planes : q's [2 (hi, lo)][batch * num_heads][seq][128] float16, then k's and v's alike
       colmax : [3][batch * num_heads][128] u32, each column's max |x| as f32 bits (NaN sorts above
                inf); zero before phase 0
   Precision: prologue_math.cuh's f32 (no -ftz, as qkv_prologue.cu), then exact power-of-two scaling;
   hi + lo = x 2^e to 2^-22 relative. */

#include "prologue_math.cuh"
#include "split_phases.cuh"

#if !defined(PS_D) || !defined(PS_IN_KIND) || !defined(PS_ROWS) || !defined(PS_THREADS)
#error "qkv_prologue_split.cu needs -D PS_D, PS_IN_KIND, PS_ROWS and PS_THREADS from the host"
#endif
#if PS_D != 128
#error "the split prologue is built for head_dim 128 only (the fp16x3 kernel's)"
#endif
#if PS_IN_KIND < 0 || PS_IN_KIND > 2
#error "PS_IN_KIND must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif
#define PS_WARPS 8
static_assert(PS_THREADS == 32 * PS_WARPS, "PS_THREADS must be 256: the kernel runs 8 warps");
static_assert(PS_ROWS % PS_WARPS == 0, "PS_ROWS must be a multiple of the 8 warps");

typedef pk_storage<PS_IN_KIND>::type ps_in_t;

extern "C" __global__ void __launch_bounds__(PS_THREADS)
qkv_prologue_split(
    PK_PROLOGUE_INPUTS(ps_in_t),
    unsigned short* __restrict__ planes, unsigned int* __restrict__ colmax,
    PK_PROLOGUE_STRIDES,
    unsigned int text_len, unsigned int seq, unsigned int num_heads,
    float eps_q, float eps_k, int has_rope, unsigned int phase)
{
    const pk_split_block blk = pk_split_block_at<PS_ROWS>(seq, seq);
    if (blk.rows == 0) return;
    const pk_prologue<PS_IN_KIND> in = PK_PROLOGUE_GATHER;
    const unsigned int b = blk.group / num_heads, h = blk.group % num_heads, lane = threadIdx.x & 31u;
    const pk_rotation none = {make_float4(1.f, 1.f, 1.f, 1.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    const auto values = [&](unsigned int n) {
        const pk_rotation rot = blk.tensor < 2 ? pk_rotation_at<PS_D>(in, n, lane) : none;
        return pk_prologue_value<PS_D>(in, n, b, blk.tensor, h, rot, lane);
    };
    pk_split_phase<PS_WARPS, PS_D>(blk, values, planes, colmax, phase);
}
