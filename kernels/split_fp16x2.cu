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
   planes. colmax must be zero before phase 0.

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

#include "fp16_split.cuh"

#if !defined(SP_D) || !defined(SP_ROWS) || !defined(SP_THREADS)
#error "split_fp16x2.cu needs -D SP_D, SP_ROWS and SP_THREADS from the host"
#endif
#if SP_D != 128
#error "the fp16 split is built for head_dim 128 only"
#endif
#define SP_WARPS 8
static_assert(SP_THREADS == 32 * SP_WARPS, "SP_THREADS must be 256: the kernel runs 8 warps");
static_assert(SP_ROWS % SP_WARPS == 0, "SP_ROWS must be a multiple of the 8 warps");

/* Largest of the 128 column maxima of one (tensor, batch*head) group, in every lane. */
__device__ __forceinline__ unsigned int sp_group_max(const unsigned int* colmax, unsigned int lane)
{
    const uint4 c = *(const uint4*)(colmax + 4 * lane);
    unsigned int m = max(max(c.x, c.y), max(c.z, c.w));
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
}

/* |x| as an orderable bit pattern: for non-negative floats unsigned order is numeric
   order, and a NaN's pattern sorts above inf. */
__device__ __forceinline__ unsigned int sp_abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

__device__ __forceinline__ void sp_column_max(const float* src, unsigned int rows, unsigned int* colmax,
                                              unsigned int lane, unsigned int warp)
{
    __shared__ uint4 partial[SP_WARPS][SP_D / 4];
    uint4 m = make_uint4(0u, 0u, 0u, 0u);
    for (unsigned int r = warp; r < rows; r += SP_WARPS) {
        const float4 x = *(const float4*)(src + (unsigned long long)r * SP_D + 4 * lane);
        m = make_uint4(max(m.x, sp_abs_bits(x.x)), max(m.y, sp_abs_bits(x.y)), max(m.z, sp_abs_bits(x.z)),
                       max(m.w, sp_abs_bits(x.w)));
    }
    partial[warp][lane] = m;
    __syncthreads();
    if (threadIdx.x < SP_D) {
        const unsigned int* column = (const unsigned int*)&partial[0][0] + threadIdx.x;
        unsigned int best = 0;
        #pragma unroll
        for (int w = 0; w < SP_WARPS; w++) best = max(best, column[w * SP_D]);
        atomicMax(colmax + threadIdx.x, best);
    }
}

__device__ __forceinline__ void sp_write_planes(const float* src, unsigned int rows, unsigned short* hi,
                                                unsigned short* lo, float4 scale, unsigned int lane,
                                                unsigned int warp)
{
    for (unsigned int r = warp; r < rows; r += SP_WARPS) {
        const unsigned long long at = (unsigned long long)r * SP_D + 4 * lane;
        const float4 x = *(const float4*)(src + at);
        const uint2 a = pk_split2_f16(x.x * scale.x, x.y * scale.y);
        const uint2 b = pk_split2_f16(x.z * scale.z, x.w * scale.w);
        *(uint2*)(hi + at) = make_uint2(a.x, b.x);
        *(uint2*)(lo + at) = make_uint2(a.y, b.y);
    }
}

extern "C" __global__ void __launch_bounds__(SP_THREADS)
split_fp16x2(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
             unsigned short* __restrict__ planes, unsigned int* __restrict__ colmax, unsigned int seq_q,
             unsigned int seq_k, unsigned int q_pitch, unsigned int kv_pitch, unsigned int phase)
{
    const unsigned int tensor = blockIdx.z, group = blockIdx.x, groups = gridDim.x;
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    const unsigned int seq = tensor == 0 ? seq_q : seq_k;
    const unsigned int row0 = blockIdx.y * SP_ROWS;
    if (row0 >= seq) return;
    const unsigned int rows = min(SP_ROWS, seq - row0);
    const unsigned long long pitch = tensor == 0 ? q_pitch : kv_pitch;
    const float* src = (tensor == 0 ? q : tensor == 1 ? k : v) + ((unsigned long long)group * pitch + row0) * SP_D;
    unsigned int* group_max = colmax + (tensor * groups + group) * SP_D;
    if (phase == 0) {
        sp_column_max(src, rows, group_max, lane, warp);
        return;
    }
    float4 scale;
    if (tensor == 2) {
        const uint4 c = *(const uint4*)(group_max + 4 * lane);
        scale = make_float4(ldexpf(1.f, pk_split_exponent(c.x)), ldexpf(1.f, pk_split_exponent(c.y)),
                            ldexpf(1.f, pk_split_exponent(c.z)), ldexpf(1.f, pk_split_exponent(c.w)));
    } else {
        const float s = ldexpf(1.f, pk_split_exponent(sp_group_max(group_max, lane)));
        scale = make_float4(s, s, s, s);
    }
    const unsigned long long planes_before = tensor == 0 ? 0ull : (tensor == 1 ? seq_q : seq_q + seq_k);
    unsigned short* hi = planes + (2ull * groups * planes_before + (unsigned long long)group * seq + row0) * SP_D;
    unsigned short* lo = hi + (unsigned long long)groups * seq * SP_D;
    sp_write_planes(src, rows, hi, lo, scale, lane, warp);
}
