/* key_lens.cuh: per-batch key counts for the attention kernels' KEY_LENS=1 builds, any architecture.

   A key-padding mask reaches the kernels as key counts: the host moves each batch's kept keys to
   the front of the window, and batch b attends its first key_lens[b] keys.
     pk_batch_keys          the batch's key count, clamped to the window
     pk_store_keyless_rows  a batch with no keys: output 0, LSE -inf (torch's SDPA)
     pk_no_keys             a KEY_LENS build's first step: both of the above */

#ifndef PICTOR_KEY_LENS_CUH
#define PICTOR_KEY_LENS_CUH

#include "common.cuh"

/* The keys batch blockIdx.z attends: the first key_lens[blockIdx.z] of the
   window's seq_k (clamped to [0, seq_k]), or all seq_k when key_lens is null. */
__device__ __forceinline__ unsigned int pk_batch_keys(const int* key_lens, unsigned int seq_k)
{
    return key_lens == nullptr ? seq_k : (unsigned int)min(max(key_lens[blockIdx.z], 0), (int)seq_k);
}

/* The block's query rows [blockIdx.x * rows, + rows) of head blockIdx.y when
   its batch has no keys: outputs 0 and LSE -inf, what torch's SDPA gives a
   row whose keys are all masked. out: token-major [batch, out_pitch,
   num_heads * head_dim] of dtype KIND (0 is 0 in every dtype), at the
   window's first row; rows >= seq_q are left alone. */
template <int KIND>
__device__ __forceinline__ void pk_store_keyless_rows(typename pk_storage<KIND>::type* out, float* lse,
                                                      unsigned int rows, unsigned int seq_q, unsigned int num_heads,
                                                      unsigned int head_dim, unsigned int out_pitch)
{
    for (unsigned int i = threadIdx.x; i < rows * head_dim; i += blockDim.x) {
        const unsigned int row = blockIdx.x * rows + i / head_dim, col = i % head_dim;
        if (row >= seq_q) continue;
        const unsigned long long token = (unsigned long long)blockIdx.z * out_pitch + row;
        out[(token * num_heads + blockIdx.y) * head_dim + col] = 0;
        if (col == 0 && lse != nullptr) lse[token * num_heads + blockIdx.y] = PK_NEG_INF;
    }
}

/* A key-count build's first step: seq_k becomes the batch's key count
   (pk_batch_keys); when it is 0 the block stores its keyless rows
   (pk_store_keyless_rows) and returns true, and the kernel returns. */
template <int KIND>
__device__ __forceinline__ bool pk_no_keys(const int* key_lens, unsigned int& seq_k,
                                           typename pk_storage<KIND>::type* out, float* lse, unsigned int rows,
                                           unsigned int seq_q, unsigned int num_heads, unsigned int head_dim,
                                           unsigned int out_pitch)
{
    seq_k = pk_batch_keys(key_lens, seq_k);
    if (seq_k != 0) return false;
    pk_store_keyless_rows<KIND>(out, lse, rows, seq_q, num_heads, head_dim, out_pitch);
    return true;
}

#endif
