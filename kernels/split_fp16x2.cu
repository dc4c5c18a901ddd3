/* split_fp16x2.cu: f32 q, k, v -> scaled float16 hi/lo planes for the fp16x3 kernel (pictor-diffusers).

   Algorithm (after Ootomo & Yokota 2022, with a power-of-two scale per group):
       x 2^e = hi + lo,  hi = fp16(x 2^e),  lo = fp16(x 2^e - hi)   (both round to nearest even)
   e puts the group's largest |x| in [2^14, 2^15) (pk_split_exponent), so hi
   cannot overflow and hi + lo keeps 22 significant bits of every value within
   2^-20 of the group's maximum. Groups: q and k one per (batch, head), v one
   per (batch, head, channel d), so v channels of any magnitude keep their
   relative precision. The attention kernel undoes the scales exactly (q and k
   in the logit scale, v on the output columns).
   Two launches of this entry: phase 0 folds |x| of each column into
   colmax[tensor][batch*head][d] (f32 bit patterns, atomicMax as unsigned: NaN
   sorts above inf and so propagates); phase 1 reads the maxima and writes the
   planes. colmax must be zero before phase 0. The phases are split_phases.cuh's,
   which qkv_prologue_split.cu runs on rows it computes instead of reading.

   Launch geometry (SP_D, SP_ROWS and SP_THREADS come from the host as -D):
       grid  = (batch * num_heads, ceil(max(seq_q, seq_k) / SP_ROWS), 3 tensors q, k, v)
       block = SP_THREADS = 256 (8 warps); warp w takes rows w, w + 8, ... of
       the block's SP_ROWS rows; lane l holds columns 4l .. 4l + 3.
   Layout (a window of rows: the host offsets q, k, v to the window's first
   row; pitches are the full tensors' row counts):
       q       : head-major [batch, num_heads, q_pitch, 128] f32, rows [0, seq_q)
       k, v    : head-major [batch, num_heads, kv_pitch, 128] f32, rows [0, seq_k)
       planes  : q's [2 (hi, lo)][batch * num_heads][seq_q][128] float16, then
                 k's and v's, each [2][batch * num_heads][seq_k][128]
       colmax  : [3][batch * num_heads][128] u32
   Precision: exact scaling by powers of two; hi + lo = x 2^e to 2^-22 relative. */

#include "split_phases.cuh"

#if !defined(SP_D) || !defined(SP_ROWS) || !defined(SP_THREADS)
#error "split_fp16x2.cu needs -D SP_D, SP_ROWS and SP_THREADS from the host"
#endif
#if SP_D != 128
#error "the fp16 split is built for head_dim 128 only"
#endif
#define SP_WARPS 8
static_assert(SP_THREADS == 32 * SP_WARPS, "SP_THREADS must be 256: the kernel runs 8 warps");
static_assert(SP_ROWS % SP_WARPS == 0, "SP_ROWS must be a multiple of the 8 warps");

extern "C" __global__ void __launch_bounds__(SP_THREADS)
split_fp16x2(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
             unsigned short* __restrict__ planes, unsigned int* __restrict__ colmax, unsigned int seq_q,
             unsigned int seq_k, unsigned int q_pitch, unsigned int kv_pitch, unsigned int phase)
{
    const pk_split_block blk = pk_split_block_at<SP_ROWS>(seq_q, seq_k);
    if (blk.rows == 0) return;
    const unsigned long long pitch = blk.tensor == 0 ? q_pitch : kv_pitch;
    const float* src = (blk.tensor == 0 ? q : blk.tensor == 1 ? k : v) + (unsigned long long)blk.group * pitch * SP_D;
    const unsigned int lane = threadIdx.x & 31u;
    const auto values = [&](unsigned int row) {
        return *(const float4*)(src + (unsigned long long)row * SP_D + 4 * lane);
    };
    pk_split_phase<SP_WARPS, SP_D>(blk, values, planes, colmax, phase);
}
