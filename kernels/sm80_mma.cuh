/* sm80_mma.cuh: Ampere (sm_80 and later) data movement for the mma.sync kernels
   (flash_attn_mma16.cu, flash_attn_tf32x3.cu).
     cp.async     pk_cp_async16, pk_cp_async16_zfill, pk_cp_async_commit, pk_cp_async_wait_all */

#ifndef PICTOR_SM80_MMA_CUH
#define PICTOR_SM80_MMA_CUH

#include "common.cuh"

/* 16 bytes global -> shared (L2 only), completing at a later wait. */
__device__ __forceinline__ void pk_cp_async16(unsigned int dst, const void* src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}

/* The same, reading src_bytes (0 or 16) and zero-filling the rest. */
__device__ __forceinline__ void pk_cp_async16_zfill(unsigned int dst, const void* src, unsigned int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void pk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void pk_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

#endif
