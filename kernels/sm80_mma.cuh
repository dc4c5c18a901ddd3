/* sm80_mma.cuh: Ampere (sm_80 and later) copies and warp matrix products for the mma.sync kernels
   (flash_attn_mma16.cu, flash_attn_tf32x3.cu).
     cp.async     pk_cp_async16, pk_cp_async16_zfill, pk_cp_async_commit, pk_cp_async_wait_all
     ldmatrix     pk_ldsm_x4, pk_ldsm_x4_trans: four 8 x 8 16-bit matrices, one row address per lane
     mma.sync     pk_mma_m16n8k16<KIND> (KIND 1 bfloat16, 2 float16), pk_mma_m16n8k8_tf32; f32
                  accumulators c (+)= a b in the accumulator layout of softmax.cuh */

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

/* ---- ldmatrix ---- */

__device__ __forceinline__ void pk_ldsm_x4(unsigned int addr, unsigned int* r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void pk_ldsm_x4_trans(unsigned int addr, unsigned int* r)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

/* ---- mma.sync ---- */

template <int KIND>
__device__ __forceinline__ void pk_mma_m16n8k16(float* c, const unsigned int* a, unsigned int b0, unsigned int b1)
{
    static_assert(KIND == 1 || KIND == 2, "pk_mma_m16n8k16: KIND 1 (bfloat16) or 2 (float16)");
    if constexpr (KIND == 1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/* a and b are TF32 bit patterns. */
__device__ __forceinline__ void pk_mma_m16n8k8_tf32(float* c, unsigned int a0, unsigned int a1, unsigned int a2,
                                                    unsigned int a3, unsigned int b0, unsigned int b1)
{
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

#endif
