/* common.cuh: device helpers for every pictor-diffusers kernel, on any architecture.

   The headers of kernels/, by role and architecture (each includes the ones it builds on; the host
   hands all of them to NVRTC in memory under these names, and nvcc builds pass -I kernels):
     common.cuh         any arch: reductions, fast math, 16-bit packing and stores, shared addresses
     attention_io.cuh   any arch: the attention kernels' operands and per-batch key counts
     tile_schedule.cuh  any arch: the work tiles of an attention launch and which block runs each
     epilogue.cuh       any arch: a warpgroup's finished rows, rounded; their log-sum-exp stored
     softmax.cuh        any arch: the online softmax on mma.sync / wgmma accumulator tiles, the LSE
     quant_rows.cuh     sm_80+: 16-bit rows to int8 codes and NaN-keeping maxima (quantize_qkv8.cu)
     q8_scores.cuh      sm_80+: the 8-bit kernel's s32 scores as biased f32, its per-row state
     pv_e4m3.cuh        sm_90a: the 8-bit kernel's P.V on FP8 E4M3 (softmax, P packing, promotion)
     pv_u8.cuh          sm_90a: the 8-bit kernel's P.V on u8 P and int8 V (the same functions)
     fp16_split.cuh     any arch: f32 -> scaled float16 hi + lo (split_fp16x2.cu, qkv_prologue_split.cu,
                        flash_attn_fp16x3.cu)
     split_phases.cuh   any arch: the split's two phases (column maxima, planes) over a block of rows
                        (split_fp16x2.cu, qkv_prologue_split.cu)
     prologue_math.cuh  any arch: the prologue's projection loads, QK RMSNorm and RoPE per lane
                        (qkv_prologue.cu, qkv_prologue_split.cu)
     sm80_mma.cuh       sm_80+: cp.async, ldmatrix and mma.sync (flash_attn_mma16.cu, flash_attn_tf32x3.cu)
     sm90_pipeline.cuh  sm_90a: TMA copies, the mbarrier K/V ring, the producer and consumer warpgroups
     sm90_wgmma.cuh     sm_90a: wgmma descriptors, instructions and their ordering
     sm90_store.cuh     sm_90a: finished rows staged in shared memory (stmatrix), stored by TMA; rows of
                        batches without keys
     key_bias.cuh       sm_90a: an additive bias per key (SDPA's float mask over keys), copied beside each K
                        tile and added to the scores (flash_attn_wgmma.cu's WG_KEY_BIAS builds)
   The three Hopper kernels (flash_attn_wgmma.cu, flash_attn_fp16x3.cu, flash_attn_fp8.cu) keep only
   their shared-memory map, tile copies, main loop and epilogue; the pipeline and the instructions are
   shared, as FlashAttention-3's hopper/ keeps pipeline, main loop, softmax and epilogue apart.
   Helpers are __device__ __forceinline__ functions named pk_* (macros PK_*); none reads a kernel's -D
   geometry (sizes come in as template arguments), so a kernel's machine code is what it would be with
   the helper written out in place.

     Reductions   pk_warp_sum (32 lanes), pk_quad_sum, pk_quad_max (the four
                  lanes t = lane & 3 that share a row of an mma accumulator)
     Fast math    pk_exp2 (ex2.approx.ftz), pk_exp2_by<FAST>, pk_rcp (rcp.approx.ftz)
     Dtypes       pk_storage<KIND>, pk_pack2<KIND>, pk_store2<KIND>, pk_store4<KIND>:
                  KIND 0 is f32, 1 bfloat16, 2 float16 (16-bit values travel
                  as raw bit patterns in unsigned short); f32 -> 16-bit rounds
                  to nearest even (cvt.rn)
     Shared       pk_smem_addr: a shared-memory pointer as the 32-bit address PTX takes */

#ifndef PICTOR_COMMON_CUH
#define PICTOR_COMMON_CUH

#define PK_NEG_INF (-__int_as_float(0x7f800000))

/* ---- reductions ---- */

__device__ __forceinline__ float pk_warp_sum(float x)
{
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

__device__ __forceinline__ float pk_quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

__device__ __forceinline__ float pk_quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    return x;
}

/* ---- fast math ---- */

/* 2^x on the special-function unit; subnormal results flush to zero, which
   only drops probabilities below 2^-126. */
__device__ __forceinline__ float pk_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float pk_rcp(float x)
{
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* 2^x by pk_exp2 when FAST, else by exp2f (which keeps subnormal results). */
template <bool FAST>
__device__ __forceinline__ float pk_exp2_by(float x)
{
    return FAST ? pk_exp2(x) : exp2f(x);
}

/* ---- dtypes ---- */

/* How a value of dtype KIND is stored: f32, or 16-bit bit patterns. */
template <int KIND> struct pk_storage { typedef unsigned short type; };
template <> struct pk_storage<0> { typedef float type; };

/* Two f32 rounded to nearest even, lo in bits 0..15 and hi in bits 16..31. */
template <int KIND>
__device__ __forceinline__ unsigned int pk_pack2(float lo, float hi)
{
    static_assert(KIND == 1 || KIND == 2, "pk_pack2: KIND 1 (bfloat16) or 2 (float16)");
    unsigned int r;
    if constexpr (KIND == 1) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

/* dst[0..1] = (a, b) in dtype KIND; dst 4-byte (16-bit) or 8-byte (f32) aligned. */
template <int KIND>
__device__ __forceinline__ void pk_store2(typename pk_storage<KIND>::type* dst, float a, float b)
{
    if constexpr (KIND == 0) {
        *(float2*)dst = make_float2(a, b);
    } else {
        *(unsigned int*)dst = pk_pack2<KIND>(a, b);
    }
}

/* dst[0..3] = x in dtype KIND; dst 8-byte (16-bit) or 16-byte (f32) aligned. */
template <int KIND>
__device__ __forceinline__ void pk_store4(typename pk_storage<KIND>::type* dst, float4 x)
{
    if constexpr (KIND == 0) {
        *(float4*)dst = x;
    } else {
        *(uint2*)dst = make_uint2(pk_pack2<KIND>(x.x, x.y), pk_pack2<KIND>(x.z, x.w));
    }
}

/* ---- shared memory ---- */

__device__ __forceinline__ unsigned int pk_smem_addr(const void* p)
{
    return (unsigned int)__cvta_generic_to_shared(p);
}

#endif
