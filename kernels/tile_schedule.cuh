/* tile_schedule.cuh: which work tiles a block of an attention kernel runs, any architecture.

   A work tile is BQ query rows of one head in one batch, over that batch's keys. A launch's work tiles
   are numbered query block fastest, then head, then batch, so the blocks running at once share heads and
   their K and V come from L2.
     pk_work              one work tile: first row, head, batch, its key count and key tiles
     pk_tile_schedule     the numbering; at(w) for persistent kernels (block b takes tiles b,
                          b + gridDim.x, ...), own() for one block per tile (blockIdx.x, .y, .z)
   KEY_LENS: each batch's key count is read from key_lens (attention_io.cuh's pk_keys_of), so a work
   tile may have no key tiles; without it every tile attends the window's seq_k >= 1 keys. */

#ifndef PICTOR_TILE_SCHEDULE_CUH
#define PICTOR_TILE_SCHEDULE_CUH

#include "attention_io.cuh"

struct pk_work {
    unsigned int q0, head, batch, seq_k, n_tiles;
};

template <int BQ, int BK, bool KEY_LENS>
struct pk_tile_schedule {
    unsigned int q_blocks, num_heads, seq_k, n_work;
    const int* key_lens;

    __device__ static pk_tile_schedule of(unsigned int seq_q, unsigned int num_heads, unsigned int seq_k,
                                          unsigned int batch, const int* key_lens)
    {
        const unsigned int q_blocks = (seq_q + BQ - 1) / BQ;
        return {q_blocks, num_heads, seq_k, q_blocks * num_heads * batch, key_lens};
    }
    __device__ pk_work tile(unsigned int q_block, unsigned int head, unsigned int batch) const
    {
        pk_work t;
        t.q0 = q_block * BQ;
        t.head = head;
        t.batch = batch;
        t.seq_k = KEY_LENS ? pk_keys_of(key_lens, batch, seq_k) : seq_k;
        t.n_tiles = (t.seq_k + BK - 1) / BK;
        return t;
    }
    __device__ pk_work at(unsigned int w) const
    {
        return tile(w % q_blocks, (w / q_blocks) % num_heads, w / q_blocks / num_heads);
    }
    __device__ pk_work own() const { return tile(blockIdx.x, blockIdx.y, blockIdx.z); }
    __device__ bool has_keys(const pk_work& t) const { return !KEY_LENS || t.n_tiles != 0; }
};

#endif
