/* split_phases.cuh: the fp16 split's two phases over one block of rows, any architecture: the shared body
   of split_fp16x2.cu (rows read from f32 q, k, v) and qkv_prologue_split.cu (rows computed from the
   projections), which differ only in where a row's f32 values come from.
     pk_split_block_at  the block's tensor, (batch, head) group and rows
     pk_split_phase     phase 0: fold each column's max |x| into colmax; phase 1: write the hi/lo planes

   Grid: (groups = batch * heads, ceil(max(seq_q, seq_k) / ROWS), 3 tensors q, k, v); a block of WARPS
   warps takes ROWS rows of one (tensor, group): warp w rows w, w + WARPS, ...; lane l columns 4l .. 4l + 3
   of the D = 128 columns. Layout: planes hold q's [2 (hi, lo)][groups][seq_q][D] float16, then k's and
   v's, each [2][groups][seq_k][D]; colmax [3][groups][D] u32 (f32 bit patterns, atomicMax as unsigned:
   NaN sorts above inf and so propagates), zero before phase 0. Scale groups: q and k one per group, v one
   per (group, column). */

#ifndef PICTOR_SPLIT_PHASES_CUH
#define PICTOR_SPLIT_PHASES_CUH

#include "fp16_split.cuh"

/* One block's share of the split: rows [row0, row0 + rows) of `tensor` (0 q, 1 k, 2 v) in `group`. */
struct pk_split_block {
    unsigned int tensor, group, groups, row0, rows, seq_q, seq_k;
    __device__ unsigned int seq() const { return tensor == 0 ? seq_q : seq_k; }
};

/* This block's rows (rows = 0: past its tensor's end, nothing to do). */
template <int ROWS>
__device__ __forceinline__ pk_split_block pk_split_block_at(unsigned int seq_q, unsigned int seq_k)
{
    pk_split_block blk;
    blk.tensor = blockIdx.z;
    blk.group = blockIdx.x;
    blk.groups = gridDim.x;
    blk.row0 = blockIdx.y * ROWS;
    blk.seq_q = seq_q;
    blk.seq_k = seq_k;
    const unsigned int seq = blk.seq();
    blk.rows = blk.row0 < seq ? min((unsigned int)ROWS, seq - blk.row0) : 0u;
    return blk;
}

/* Phase 0: the block's column maxima of |x| folded into its group's colmax, one atomicMax per column.
   values(row) gives columns 4 lane .. 4 lane + 3 of `row` (absolute, warp-uniform) as f32. */
template <int WARPS, int D, typename Values>
__device__ __forceinline__ void pk_split_column_max(const pk_split_block& blk, Values values,
                                                    unsigned int* group_max, unsigned int lane, unsigned int warp)
{
    static_assert(D == 128, "the split's lanes cover 128 columns");
    __shared__ uint4 partial[WARPS][D / 4];
    uint4 m = make_uint4(0u, 0u, 0u, 0u);
    for (unsigned int r = warp; r < blk.rows; r += WARPS) m = pk_abs_max4(m, values(blk.row0 + r));
    partial[warp][lane] = m;
    __syncthreads();
    if (threadIdx.x < D) {
        const unsigned int* column = (const unsigned int*)&partial[0][0] + threadIdx.x;
        unsigned int best = 0;
        #pragma unroll
        for (int w = 0; w < WARPS; w++) best = max(best, column[w * D]);
        atomicMax(group_max + threadIdx.x, best);
    }
}

/* Phase 1: the block's rows times their scales (from the complete colmax) as hi and lo planes. */
template <int WARPS, int D, typename Values>
__device__ __forceinline__ void pk_split_write(const pk_split_block& blk, Values values, unsigned short* planes,
                                               const unsigned int* group_max, unsigned int lane, unsigned int warp)
{
    const float4 scale = pk_split_scales(group_max, blk.tensor == 2, lane);
    const unsigned int seq = blk.seq();
    const unsigned long long before = blk.tensor == 0 ? 0ull : (blk.tensor == 1 ? blk.seq_q : blk.seq_q + blk.seq_k);
    unsigned short* hi = planes + (2ull * blk.groups * before + (unsigned long long)blk.group * seq + blk.row0) * D;
    unsigned short* lo = hi + (unsigned long long)blk.groups * seq * D;
    for (unsigned int r = warp; r < blk.rows; r += WARPS) {
        const unsigned long long at = (unsigned long long)r * D + 4 * lane;
        pk_split4_store(values(blk.row0 + r), scale, hi + at, lo + at);
    }
}

/* One block's part of `phase` (0: column maxima, 1: planes) for the block `blk` (rows > 0). */
template <int WARPS, int D, typename Values>
__device__ __forceinline__ void pk_split_phase(const pk_split_block& blk, Values values, unsigned short* planes,
                                               unsigned int* colmax, unsigned int phase)
{
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned int* group_max = colmax + (blk.tensor * blk.groups + blk.group) * D;
    if (phase == 0) {
        pk_split_column_max<WARPS, D>(blk, values, group_max, lane, warp);
    } else {
        pk_split_write<WARPS, D>(blk, values, planes, group_max, lane, warp);
    }
}

#endif
