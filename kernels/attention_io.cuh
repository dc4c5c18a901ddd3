/* attention_io.cuh: what the attention kernels take and give at their boundary, any architecture.

   Operands     PK_POINTER_OPERANDS, PK_MAP_OPERANDS: a kernel's leading parameters, in the order of
                the registry's operand kinds "pointers" and "tensor_maps" (launch.py passes them);
                PK_POINTER_SCALARS, PK_MAP_SCALARS: the scalars that follow them
   Key counts   a key-padding mask reaches the kernels as key counts, in their KEY_LENS=1 builds (a
                KEY_LENS=0 build is the kernel without them): the host moves each batch's kept keys
                to the front of the window, and batch b attends its first key_lens[b] keys, clamped
                to [0, seq_k]; a batch with none gets rows of 0 and LSE -inf, as torch's SDPA gives.
                  pk_keys_of             a batch's key count, clamped to the window
                  pk_batch_keys          the same for the block's batch, blockIdx.z
                  pk_store_keyless_tile  a batch with no keys: output 0, LSE -inf (torch's SDPA)
                  pk_store_keyless_rows  the same for the block's own rows
                  pk_no_keys             a KEY_LENS build's first step: both of the above
                  PK_HOLD_KEYS           pk_no_keys, then the count kept in shared memory
                                         (PK_HELD_KEYS), for the mma.sync kernels */

#ifndef PICTOR_ATTENTION_IO_CUH
#define PICTOR_ATTENTION_IO_CUH

#include "common.cuh"

/* q, k, v (IN_T, head-major planes), out (OUT_T, token-major), lse (f32, or null), key_lens (i32, or null). */
#define PK_POINTER_OPERANDS(IN_T, OUT_T)                                                                 \
    const IN_T* __restrict__ q, const IN_T* __restrict__ k, const IN_T* __restrict__ v,                   \
        OUT_T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ key_lens

/* TMA maps of q, k, v (pk_tensor_map, sm90_pipeline.cuh), then out, lse and key_lens as above. */
#define PK_MAP_OPERANDS(OUT_T)                                                                            \
    const __grid_constant__ pk_tensor_map tm_q, const __grid_constant__ pk_tensor_map tm_k,                \
        const __grid_constant__ pk_tensor_map tm_v, OUT_T* __restrict__ out, float* __restrict__ lse,      \
        const int* __restrict__ key_lens

/* The first scalars (the registry's heads, seq_q, seq_k, then the pitches): the window a launch covers,
   and the rows between the planes of q, of k and v, and between the batches of out; the TMA kernels'
   maps carry the inputs' pitches. */
#define PK_POINTER_SCALARS                                                                              \
    unsigned int num_heads, unsigned int seq_q, unsigned int seq_k, unsigned int q_pitch,               \
        unsigned int kv_pitch, unsigned int out_pitch
#define PK_MAP_SCALARS unsigned int num_heads, unsigned int seq_q, unsigned int seq_k, unsigned int out_pitch

/* The keys batch `batch` (pk_batch_keys: blockIdx.z) attends: the first key_lens[batch] of the
   window's seq_k (clamped to [0, seq_k]), or all seq_k when key_lens is null. */
__device__ __forceinline__ unsigned int pk_keys_of(const int* key_lens, unsigned int batch, unsigned int seq_k)
{
    return key_lens == nullptr ? seq_k : (unsigned int)min(max(key_lens[batch], 0), (int)seq_k);
}

__device__ __forceinline__ unsigned int pk_batch_keys(const int* key_lens, unsigned int seq_k)
{
    return pk_keys_of(key_lens, blockIdx.z, seq_k);
}

/* Query rows [row0, row0 + rows) of head `head` in batch `batch` when that batch has no keys: outputs 0
   and LSE -inf, what torch's SDPA gives a row whose keys are all masked, written by threads `tid` of
   `threads`. out: token-major [batch, out_pitch, num_heads * head_dim] of dtype KIND (0 is 0 in every
   dtype), at the window's first row; rows >= seq_q are left alone. */
template <int KIND>
__device__ __forceinline__ void pk_store_keyless_tile(typename pk_storage<KIND>::type* out, float* lse,
                                                      unsigned int row0, unsigned int rows, unsigned int head,
                                                      unsigned int batch, unsigned int seq_q, unsigned int num_heads,
                                                      unsigned int head_dim, unsigned int out_pitch, unsigned int tid,
                                                      unsigned int threads)
{
    for (unsigned int i = tid; i < rows * head_dim; i += threads) {
        const unsigned int row = row0 + i / head_dim, col = i % head_dim;
        if (row >= seq_q) continue;
        const unsigned long long token = (unsigned long long)batch * out_pitch + row;
        out[(token * num_heads + head) * head_dim + col] = 0;
        if (col == 0 && lse != nullptr) lse[token * num_heads + head] = PK_NEG_INF;
    }
}

/* pk_store_keyless_tile for the block's own rows [blockIdx.x * rows, + rows) of head blockIdx.y in
   batch blockIdx.z, by all its threads. */
template <int KIND>
__device__ __forceinline__ void pk_store_keyless_rows(typename pk_storage<KIND>::type* out, float* lse,
                                                      unsigned int rows, unsigned int seq_q, unsigned int num_heads,
                                                      unsigned int head_dim, unsigned int out_pitch)
{
    pk_store_keyless_tile<KIND>(out, lse, blockIdx.x * rows, rows, blockIdx.y, blockIdx.z, seq_q, num_heads,
                                head_dim, out_pitch, threadIdx.x, blockDim.x);
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

/* The mma.sync kernels' KEY_LENS step, in the kernel body (key_lens, seq_k, out, lse, seq_q, num_heads
   and out_pitch are its parameters): pk_no_keys, then thread 0 keeps the count in shared memory, where
   each use re-reads it (PK_HELD_KEYS) after a __syncthreads: at head_dim 128 the accumulators take
   every register. */
#define PK_HOLD_KEYS(KIND, ROWS, D)                                                                   \
    __shared__ unsigned int pk_held_keys;                                                             \
    if (pk_no_keys<KIND>(key_lens, seq_k, out, lse, ROWS, seq_q, num_heads, D, out_pitch)) return;    \
    if (threadIdx.x == 0) pk_held_keys = seq_k
#define PK_HELD_KEYS (*(volatile unsigned int*)&pk_held_keys)

#endif
