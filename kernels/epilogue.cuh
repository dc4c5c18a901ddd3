/* epilogue.cuh: a consumer warpgroup's finished rows of an attention work tile, any architecture.

   A warpgroup holds 64 query rows of a work tile (pk_work, tile_schedule.cuh) as 4 warps x 16 rows of
   m64nD accumulators (softmax.cuh's layout: thread (g, t) of warp w holds rows 16w + g and 16w + g + 8,
   columns 8n + 2t and 8n + 2t + 1). Finishing them: round every value first, then write (the 16-bit rows
   go out through shared memory, sm90_store.cuh; the LSE from registers):
     pk_out_rows<D>          a thread's rounded rows: O / l packed two per register, the LSE, the tile
     pk_round_out<KIND, D>   accumulators and running softmax (m in log2 units, l per thread) -> rows
     pk_write_lse<D>         the rows' LSE into lse ([batch, out_pitch, heads] f32, natural log, or null) */

#ifndef PICTOR_EPILOGUE_CUH
#define PICTOR_EPILOGUE_CUH

#include "tile_schedule.cuh"

template <int D>
struct pk_out_rows {
    unsigned int packed[D / 4];   /* packed[2n + r]: row r's columns 8n + 2t, 8n + 2t + 1 */
    float lse[2];
    pk_work wk;
};

/* O / l rounded to nearest even in dtype KIND, and ln(l) + m ln 2, for the thread's two rows. EMPTY_ROWS: a
   row may have l = 0 (every key's weight 0, softmax.cuh): its output is 0 and its LSE -inf. */
template <int KIND, int D, bool EMPTY_ROWS = false>
__device__ __forceinline__ void pk_round_out(pk_out_rows<D>& r, const float* o, const float* m_run,
                                             const float* l_run, const pk_work& wk)
{
    r.wk = wk;
    #pragma unroll
    for (int row = 0; row < 2; row++) {
        const float l = pk_quad_sum(l_run[row]), inv = EMPTY_ROWS && l == 0.f ? 0.f : 1.f / l;
        r.lse[row] = (m_run[row] + log2f(l)) * 0.6931471805599453f;
        #pragma unroll
        for (int n = 0; n < D / 8; n++) {
            r.packed[2 * n + row] = pk_pack2<KIND>(o[4 * n + 2 * row] * inv, o[4 * n + 2 * row + 1] * inv);
        }
    }
}

/* The log-sum-exp of `r`'s rows (the warpgroup's first row in its tile: rows0) into lse ([batch,
   out_pitch, num_heads] f32, natural log), one thread per row; rows >= seq_q are not written. */
template <int D>
__device__ __forceinline__ void pk_write_lse(const pk_out_rows<D>& r, unsigned int rows0, float* __restrict__ lse,
                                             unsigned int num_heads, unsigned int seq_q, unsigned int out_pitch)
{
    if (lse == nullptr || (threadIdx.x & 3u) != 0) return;
    const unsigned int warp = (threadIdx.x / 32) & 3u, g = (threadIdx.x & 31u) >> 2;
    #pragma unroll
    for (int row = 0; row < 2; row++) {
        const unsigned int q = r.wk.q0 + rows0 + warp * 16 + g + 8 * row;
        if (q < seq_q) lse[((unsigned long long)r.wk.batch * out_pitch + q) * num_heads + r.wk.head] = r.lse[row];
    }
}

#endif
