/* sm90_wgmma.cuh: Hopper (sm_90a) warpgroup matrix products for the wgmma kernels
   (flash_attn_wgmma.cu, flash_attn_fp16x3.cu, flash_attn_fp8.cu): every wgmma.mma_async they issue.
     Descriptors  pk_wgmma_desc (128-byte swizzle), pk_desc_advance
     Ordering     pk_wgmma_fence, pk_wgmma_commit, pk_wgmma_wait<N>, pk_pin<N>
     Tiles        pk_tile_qk, pk_tile_pv, pk_pack_p: a 128- or 176-key tile's S and P.V at 16 bits
     Products     one warpgroup, m64, A (64 rows) from shared memory (_ss) or registers (_rs);
                  `accumulate` 0 overwrites the accumulators (scale-d 0):
                    pk_wgmma_n176_ss<KIND>, pk_wgmma_n128_ss<KIND>,
                    pk_wgmma_n64_ss<KIND>                          16-bit, f32 accumulators
                    pk_wgmma_n128_rs<KIND>, pk_wgmma_n64_rs<KIND>  16-bit, B MN-major (transposed)
                    pk_wgmma_n128_s8_ss                            int8 x int8 -> s32 (exact)
                    pk_wgmma_n128_e4m3_rs, pk_wgmma_n8_e4m3_rs     FP8 E4M3, f32 accumulators
                    pk_wgmma_n128_u8s8_rs, pk_wgmma_n8_u8s8_rs     uint8 x int8 -> s32 (exact)
                  KIND 1 is bfloat16, 2 float16; B is K-major unless said otherwise.
   Their asm text is built by PK_WGMMA (and PK_WGMMA_16BIT, which picks the 16-bit dtype): the
   accumulators are the first asm operands, PK_ACCn names n of them in the instruction, PK_Fn (f32) and
   PK_Rn (s32) bind them, read and written. */

#ifndef PICTOR_SM90_WGMMA_CUH
#define PICTOR_SM90_WGMMA_CUH

#include "common.cuh"

/* Shared-memory matrix descriptor, 128-byte swizzle; lead and stride in bytes. */
__device__ __forceinline__ unsigned long long pk_wgmma_desc(unsigned int addr, unsigned int lead, unsigned int stride)
{
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

/* The same descriptor `bytes` further on (a multiple of 16; the address field is addr >> 4 and the smem
   window is < 2^18 bytes, so the add cannot carry out of it): one add instead of a descriptor rebuilt. */
__device__ __forceinline__ unsigned long long pk_desc_advance(unsigned long long desc, unsigned int bytes)
{
    return desc + (bytes >> 4);
}

__device__ __forceinline__ void pk_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void pk_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void pk_wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

#define PK_ACC32                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "         \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define PK_ACC64                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define PK_ACC88                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
    "%80, %81, %82, %83, %84, %85, %86, %87}"
#define PK_F4(a, i) "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3])
#define PK_F8(a, i) "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), \
                    "+f"(a[i + 4]), "+f"(a[i + 5]), "+f"(a[i + 6]), "+f"(a[i + 7])
#define PK_F32(a) PK_F8(a, 0), PK_F8(a, 8), PK_F8(a, 16), PK_F8(a, 24)
#define PK_F64(a) PK_F8(a, 0), PK_F8(a, 8), PK_F8(a, 16), PK_F8(a, 24), \
                  PK_F8(a, 32), PK_F8(a, 40), PK_F8(a, 48), PK_F8(a, 56)
#define PK_F88(a) PK_F64(a), PK_F8(a, 64), PK_F8(a, 72), PK_F8(a, 80)
#define PK_R8(a, i) "+r"(a[i]), "+r"(a[i + 1]), "+r"(a[i + 2]), "+r"(a[i + 3]), \
                    "+r"(a[i + 4]), "+r"(a[i + 5]), "+r"(a[i + 6]), "+r"(a[i + 7])
#define PK_R64(a) PK_R8(a, 0), PK_R8(a, 8), PK_R8(a, 16), PK_R8(a, 24), \
                  PK_R8(a, 32), PK_R8(a, 40), PK_R8(a, 48), PK_R8(a, 56)

/* One wgmma.mma_async, as asm text: p = (operand d != 0) is its scale-d, so `accumulate` 0 overwrites
   the accumulators; SHAPE_TYPES is the instruction's suffix and OPERANDS its operand list. */
#define PK_WGMMA(d, SHAPE_TYPES, OPERANDS)                                                        \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #d ", 0;\n"                                              \
    "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " OPERANDS ";\n}\n"

/* A 16-bit wgmma of dtype KIND (1: .bf16, 2: .f16 inputs; f32 accumulators); the asm operands follow. */
#define PK_WGMMA_16BIT(KIND, d, SHAPE, OPERANDS, ...)                                           \
    static_assert(KIND == 1 || KIND == 2, "a 16-bit wgmma: KIND 1 (bfloat16) or 2 (float16)"); \
    if constexpr (KIND == 1) {                                                                 \
        asm volatile(PK_WGMMA(d, SHAPE ".f32.bf16.bf16", OPERANDS) : __VA_ARGS__);             \
    } else {                                                                                   \
        asm volatile(PK_WGMMA(d, SHAPE ".f32.f16.f16", OPERANDS) : __VA_ARGS__);               \
    }

/* acc[0..87] (+)= A B^T, m64n176k16, A and B from shared memory. */
template <int KIND>
__device__ __forceinline__ void pk_wgmma_n176_ss(float* acc, unsigned long long a, unsigned long long b, int accumulate)
{
    PK_WGMMA_16BIT(KIND, 90, "m64n176k16", PK_ACC88 ", %88, %89, p, 1, 1, 0, 0",
                   PK_F88(acc) : "l"(a), "l"(b), "r"(accumulate));
}

/* acc[0..63] (+)= A B^T, m64n128k16, A and B from shared memory. */
template <int KIND>
__device__ __forceinline__ void pk_wgmma_n128_ss(float* acc, unsigned long long a, unsigned long long b, int accumulate)
{
    PK_WGMMA_16BIT(KIND, 66, "m64n128k16", PK_ACC64 ", %64, %65, p, 1, 1, 0, 0",
                   PK_F64(acc) : "l"(a), "l"(b), "r"(accumulate));
}

/* acc[0..31] (+)= A B^T, m64n64k16, A and B from shared memory. */
template <int KIND>
__device__ __forceinline__ void pk_wgmma_n64_ss(float* acc, unsigned long long a, unsigned long long b, int accumulate)
{
    PK_WGMMA_16BIT(KIND, 34, "m64n64k16", PK_ACC32 ", %32, %33, p, 1, 1, 0, 0",
                   PK_F32(acc) : "l"(a), "l"(b), "r"(accumulate));
}

/* acc[0..63] (+)= A B, m64n128k16: A (64 x 16) from registers in the wgmma A-fragment layout,
   B (16 x 128) from shared memory, MN-major (transposed). */
template <int KIND>
__device__ __forceinline__ void pk_wgmma_n128_rs(float* acc, const unsigned int* a, unsigned long long b,
                                                 int accumulate)
{
    PK_WGMMA_16BIT(KIND, 69, "m64n128k16", PK_ACC64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1",
                   PK_F64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* acc[0..31] (+)= A B, m64n64k16: A (64 x 16) from registers in the wgmma A-fragment layout,
   B (16 x 64) from shared memory, MN-major (transposed). */
template <int KIND>
__device__ __forceinline__ void pk_wgmma_n64_rs(float* acc, const unsigned int* a, unsigned long long b, int accumulate)
{
    PK_WGMMA_16BIT(KIND, 37, "m64n64k16", PK_ACC32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1",
                   PK_F32(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* s[0..63] (+)= A B^T on int8 codes, m64n128k32, A and B from shared memory, s32 accumulators. */
__device__ __forceinline__ void pk_wgmma_n128_s8_ss(int* s, unsigned long long a, unsigned long long b, int accumulate)
{
    asm volatile(PK_WGMMA(66, "m64n128k32.s32.s8.s8", PK_ACC64 ", %64, %65, p")
                 : PK_R64(s) : "l"(a), "l"(b), "r"(accumulate));
}

/* acc[0..63] (+)= A B, m64n128k32 on E4M3: A (64 x 32) from registers, B from shared memory. */
__device__ __forceinline__ void pk_wgmma_n128_e4m3_rs(float* acc, const unsigned int* a, unsigned long long b,
                                                      int accumulate)
{
    asm volatile(PK_WGMMA(69, "m64n128k32.f32.e4m3.e4m3", PK_ACC64 ", {%64, %65, %66, %67}, %68, p, 1, 1")
                 : PK_F64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* acc[0..3] (+)= A B, m64n8k32 on E4M3: A (64 x 32) from registers, B (8 columns) from shared memory. */
__device__ __forceinline__ void pk_wgmma_n8_e4m3_rs(float* acc, const unsigned int* a, unsigned long long b,
                                                    int accumulate)
{
    asm volatile(PK_WGMMA(9, "m64n8k32.f32.e4m3.e4m3", "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1")
                 : PK_F4(acc, 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* acc[0..63] (+)= A B, m64n128k32, A uint8 from registers, B int8 from shared memory, s32 accumulators. */
__device__ __forceinline__ void pk_wgmma_n128_u8s8_rs(int* acc, const unsigned int* a, unsigned long long b,
                                                      int accumulate)
{
    asm volatile(PK_WGMMA(69, "m64n128k32.s32.u8.s8", PK_ACC64 ", {%64, %65, %66, %67}, %68, p")
                 : PK_R64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* acc[0..3] (+)= A B, m64n8k32, A uint8 from registers, B (8 int8 columns) from shared memory, s32. */
__device__ __forceinline__ void pk_wgmma_n8_u8s8_rs(int* acc, const unsigned int* a, unsigned long long b,
                                                    int accumulate)
{
    asm volatile(PK_WGMMA(9, "m64n8k32.s32.u8.s8", "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p")
                 : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

/* Pin N accumulators at this point of the program: the compiler must not move
   their uses above a wgmma wait, nor their definitions below a wgmma issue. */
template <int N>
__device__ __forceinline__ void pk_pin(float* acc)
{
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i]) :: "memory");
}

/* ---- key tiles of the 16-bit kernels (flash_attn_wgmma.cu) ----
   Tiles are rows x D columns of KIND, as D / 64 slabs of 64 columns (128-byte rows, TMA's 128-byte
   swizzle, rows x 128 bytes each): K and V tiles BK rows (128 or 176: a multiple of 16 keys and of the
   swizzle's 8-row atom), Q tiles Q_ROWS (64 per consumer warpgroup); one warpgroup computes 64 query rows,
   BK / 2 scores a thread (the accumulators of m64nBK: BK / 8 n8 tiles of 4 floats). */

/* S = Q K^T for one warpgroup (q_rows: its first row in a Q_ROWS-row Q tile), m64nBKk16: D / 16 k-steps,
   4 per slab; K's BK rows are 8-row groups 1024 bytes apart (SBO), its slabs BK x 128 bytes apart. */
template <int KIND, int D, int Q_ROWS, int BK>
__device__ __forceinline__ void pk_tile_qk(float* s, unsigned int q_rows, unsigned int k_tile)
{
    static_assert(BK == 128 || BK == 176, "a key tile is 128 or 176 keys");
    const unsigned long long a = pk_wgmma_desc(q_rows, 16, 1024), b = pk_wgmma_desc(k_tile, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        const unsigned int step = (kk % 4) * 32, slab = kk / 4;
        const unsigned long long a_kk = pk_desc_advance(a, slab * Q_ROWS * 128 + step);
        const unsigned long long b_kk = pk_desc_advance(b, slab * BK * 128 + step);
        if constexpr (BK == 176) {
            pk_wgmma_n176_ss<KIND>(s, a_kk, b_kk, kk > 0);
        } else {
            pk_wgmma_n128_ss<KIND>(s, a_kk, b_kk, kk > 0);
        }
    }
    pk_wgmma_commit();
}

/* O += P V: BK / 16 k-steps of 16 keys (16 rows x 128 bytes = 2048 bytes of each slab); V read transposed
   (MN-major), its 64-column slabs BK x 128 bytes apart (LBO), 8-key row groups 1024 apart (SBO). */
template <int KIND, int D, int BK>
__device__ __forceinline__ void pk_tile_pv(float* o, const unsigned int* p, unsigned int v_tile)
{
    static_assert(BK == 128 || BK == 176, "a key tile is 128 or 176 keys");
    const unsigned long long b = pk_wgmma_desc(v_tile, BK * 128, 1024);
    #pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
        const unsigned long long b_kk = pk_desc_advance(b, kk * 16 * 128);
        if constexpr (D == 128) {
            pk_wgmma_n128_rs<KIND>(o, p + 4 * kk, b_kk, 1);
        } else {
            pk_wgmma_n64_rs<KIND>(o, p + 4 * kk, b_kk, 1);
        }
    }
    pk_wgmma_commit();
}

/* P of a BK-key tile (BK / 2 scores s) as the A operand of the next P.V, BK / 4 registers: register
   4kk + c holds keys 16kk.. of the layout wgmma expects, which is S's accumulator order pairwise. */
template <int KIND, int BK>
__device__ __forceinline__ void pk_pack_p(unsigned int* p, const float* s)
{
    #pragma unroll
    for (int i = 0; i < BK / 4; i++) p[i] = pk_pack2<KIND>(s[2 * i], s[2 * i + 1]);
}

#endif
