/* sm90_store.cuh: a consumer warpgroup's finished rows (epilogue.cuh's pk_out_rows) written out through
   shared memory by bulk tensor stores (TMA, sm_90a), for flash_attn_wgmma.cu.

   The staging area is a ROWS-row tile (the work tile's: 128, or 192 with three consumer warpgroups) laid
   out as TMA's 128-byte swizzle has it, the layout the kernel's Q and K/V tiles already use: D / 64 slabs
   of 64 columns, ROWS x 128 bytes apart, 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r & 7).
   Consumer warpgroup w (0 .. ROWS / 64 - 1) owns rows [64 w, 64 w + 64) of it. Per finished work tile
   (pk_store_tile):
     pk_store_reuse          the warpgroup's first thread waits until its previous store has read the
                             area, then the warpgroup's named barrier (1 + w): the area may be written again
     pk_stage_rows<D, ROWS>  each warp's 16 rows into the area by stmatrix (8 x 8 16-bit matrices: a
                             thread's accumulator pair is a matrix fragment), D / 16 instructions a thread
     pk_store_rows<D, ROWS>  proxy fence and named barrier, then the first thread issues one box (64
                             columns x 64 rows) per slab at the work tile's rows and commits them as one
                             bulk group; rows past the map's (the window's seq_q) are not written
     pk_store_drain          before the block exits: the first thread waits until its stores have read the
                             area (the copies complete on their own)
   Where a work tile's results go: pk_out_dst; pk_store_keyless writes a work tile whose batch has no keys. */

#ifndef PICTOR_SM90_STORE_CUH
#define PICTOR_SM90_STORE_CUH

#include "epilogue.cuh"
#include "sm90_pipeline.cuh"

__device__ __forceinline__ unsigned int pk_consumer_wg() { return threadIdx.x / 128 - 1; }
__device__ __forceinline__ bool pk_store_issuer() { return (threadIdx.x & 127u) == 0; }

/* The calling consumer warpgroup's 128 threads meet (named barrier 1 + its index, 1 to 3; 0 is
   __syncthreads'). */
__device__ __forceinline__ void pk_consumer_wg_sync()
{
    asm volatile("bar.sync %0, 128;" :: "r"(1 + pk_consumer_wg()) : "memory");
}

__device__ __forceinline__ void pk_store_drain()
{
    if (pk_store_issuer()) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

__device__ __forceinline__ void pk_store_reuse()
{
    pk_store_drain();
    pk_consumer_wg_sync();
}

/* Matrix (n, half) of a warp's 16 x D rows is the fragment r.packed[2n + half] (rows 8 half + g, columns
   8n + 2t, 8n + 2t + 1 of thread (g, t)); one stmatrix.x4 stores n = 2i, 2i + 1, both halves. Lane l
   names row l % 8 of matrix l / 8. Slabs are ROWS x 128 bytes apart. */
template <int D, int ROWS>
__device__ __forceinline__ void pk_stage_rows(const pk_out_rows<D>& r, unsigned int area)
{
    const unsigned int lane = threadIdx.x & 31u, m = lane >> 3, rr = lane & 7u;
    const unsigned int row = pk_consumer_wg() * 64 + ((threadIdx.x / 32) & 3u) * 16 + 8 * (m & 1u) + rr;
    #pragma unroll
    for (int i = 0; i < D / 16; i++) {
        const unsigned int n = 2 * i + (m >> 1);
        const unsigned int dst = area + (n >> 3) * (ROWS * 128) + row * 128 + (((n & 7u) ^ rr) << 4);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(dst), "r"(r.packed[4 * i]), "r"(r.packed[4 * i + 1]), "r"(r.packed[4 * i + 2]),
                        "r"(r.packed[4 * i + 3])
                     : "memory");
    }
}

/* The staged rows of r.wk into the map `out_map` (dims D, heads, seq_q, batch; box 64 x 1 x 64 x 1, 128-byte
   swizzle) from the ROWS-row area. */
template <int D, int ROWS>
__device__ __forceinline__ void pk_store_rows(const pk_out_rows<D>& r, unsigned int area,
                                              const pk_tensor_map* out_map)
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    pk_consumer_wg_sync();
    if (!pk_store_issuer()) return;
    const unsigned int rows0 = pk_consumer_wg() * 64;
    #pragma unroll
    for (int slab = 0; slab < D / 64; slab++) {
        asm volatile(
            "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
            :: "l"((unsigned long long)out_map), "r"(64 * slab), "r"(r.wk.head), "r"(r.wk.q0 + rows0),
               "r"(r.wk.batch), "r"(area + slab * (ROWS * 128) + rows0 * 128)
            : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

/* A warpgroup's rounded rows of a finished work tile: staged in the ROWS-row tile at `area` once its
   previous store has read it, then stored from there. */
template <int D, int ROWS>
__device__ __forceinline__ void pk_store_tile(const pk_out_rows<D>& r, unsigned int area, const pk_tensor_map* out_map)
{
    pk_store_reuse();
    pk_stage_rows<D, ROWS>(r, area);
    pk_store_rows<D, ROWS>(r, area, out_map);
}

/* Where a work tile's results go: its 16-bit rows through `map` (the kernel's output map), rows of batches
   without keys through `out`, the LSE into `lse` (or nowhere: null). */
struct pk_out_dst {
    const pk_tensor_map* map;
    unsigned short* out;
    float* lse;
    unsigned int num_heads, seq_q, out_pitch;
};

/* A ROWS-row work tile whose batch has no keys, by its ROWS / 64 consumer warpgroups: rows of 0 and LSE -inf
   (attention_io.cuh). */
template <int KIND, int D, int ROWS>
__device__ __forceinline__ void pk_store_keyless(const pk_work& t, const pk_out_dst& dst)
{
    pk_store_keyless_tile<KIND>(dst.out, dst.lse, t.q0, ROWS, t.head, t.batch, dst.seq_q, dst.num_heads, D,
                                dst.out_pitch, threadIdx.x - 128, ROWS / 64 * 128);
}

#endif
