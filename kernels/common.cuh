/* common.cuh: device helpers shared by the pictor-diffusers kernels.

   Every kernel source in kernels/ includes this header as "common.cuh": the
   host hands it to NVRTC in memory under that name, and nvcc builds pass
   -I kernels. All helpers are __device__ __forceinline__ and named pk_*;
   none reads a kernel's -D geometry (sizes come in as template arguments),
   so a kernel's machine code is what it would be with the helper written
   out in place.

     Reductions   pk_warp_sum (32 lanes), pk_quad_sum, pk_quad_max (the four
                  lanes t = lane & 3 that share a row of an mma accumulator)
     Fast math    pk_exp2 (ex2.approx.ftz), pk_exp2_by<FAST>, pk_rcp (rcp.approx.ftz)
     Softmax      pk_mask_tail, pk_online_softmax, pk_rescale: the flash-attention
                  online softmax on mma.sync / wgmma accumulator tiles
     Dtypes       pk_storage<KIND>, pk_pack2<KIND>, pk_store2<KIND>, pk_store4<KIND>:
                  KIND 0 is f32, 1 bfloat16, 2 float16 (16-bit values travel
                  as raw bit patterns in unsigned short); f32 -> 16-bit rounds
                  to nearest even (cvt.rn)
     cp.async     pk_smem_addr, pk_cp_async16, pk_cp_async16_zfill,
                  pk_cp_async_commit, pk_cp_async_wait_all

   Accumulator layout (mma.sync m16n8kX, and each warp's 16 rows of a wgmma
   m64nN): an n8 tile is four floats; c0, c1 are row g = lane / 4, columns
   2t, 2t + 1 (t = lane & 3), and c2, c3 the same columns of row g + 8. A
   thread's scores for MT m16 tiles of NT n8 tiles are one flat array
   s[(mt * NT + n) * 4 + c]; its row ri = 2 * mt + r is c = 2r, 2r + 1. */

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

/* ---- online softmax on accumulator tiles ---- */

/* Keys >= seq get logit -inf. s: MT x NT tiles of scores whose first key is
   key0; a tile with every key valid (key0 + 8 * NT <= seq) is left as it is. */
template <int NT, int MT = 1>
__device__ __forceinline__ void pk_mask_tail(float* s, unsigned int key0, unsigned int seq, unsigned int t)
{
    if (key0 + 8 * NT > seq) {
        #pragma unroll
        for (int n = 0; n < NT; n++) {
            #pragma unroll
            for (int c = 0; c < 4; c++) {
                if (key0 + n * 8 + 2 * t + (c & 1) >= seq) {
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) s[(mt * NT + n) * 4 + c] = PK_NEG_INF;
                }
            }
        }
    }
}

/* One online-softmax step, in the exp2 domain, on MT x NT tiles of raw
   scores s, for the thread's 2 * MT rows ri (m_run: running max of
   scale_log2 * s; l_run: this thread's part of the running sum):
       m_new     = max(m_run, scale_log2 * max of the row over the tile and quad)
       corr[ri]  = 2^(m_run - m_new)
       s         = 2^(scale_log2 * s - m_new)
       l_run     = l_run * corr + sum of the thread's new s in the row
   Empty-row guard: m_run starts at -inf and every tile holds at least one
   valid key (pk_mask_tail leaves it finite), so m_new is finite and the
   first tile's corr is 2^-inf = 0 exactly, with no branch.
   FAST picks 2^x as in pk_exp2_by. */
template <int NT, int MT, bool FAST>
__device__ __forceinline__ void pk_online_softmax(float* s, float* m_run, float* l_run, float* corr,
                                                  float scale_log2)
{
    #pragma unroll
    for (int ri = 0; ri < 2 * MT; ri++) {
        float* row = s + (ri >> 1) * NT * 4 + 2 * (ri & 1);
        float tile_max = PK_NEG_INF;
        #pragma unroll
        for (int n = 0; n < NT; n++) tile_max = fmaxf(tile_max, fmaxf(row[4 * n], row[4 * n + 1]));
        tile_max = pk_quad_max(tile_max);
        const float m_new = fmaxf(m_run[ri], tile_max * scale_log2);
        corr[ri] = pk_exp2_by<FAST>(m_run[ri] - m_new);
        m_run[ri] = m_new;
        float row_sum = 0.f;
        #pragma unroll
        for (int n = 0; n < NT; n++) {
            row[4 * n] = pk_exp2_by<FAST>(fmaf(row[4 * n], scale_log2, -m_new));
            row[4 * n + 1] = pk_exp2_by<FAST>(fmaf(row[4 * n + 1], scale_log2, -m_new));
            row_sum += row[4 * n] + row[4 * n + 1];
        }
        l_run[ri] = l_run[ri] * corr[ri] + row_sum;
    }
}

/* o *= corr row-wise: MT x NT output tiles, corr from pk_online_softmax. */
template <int NT, int MT = 1>
__device__ __forceinline__ void pk_rescale(float* o, const float* corr)
{
    #pragma unroll
    for (int i = 0; i < MT * NT * 4; i++) o[i] *= corr[2 * (i / (NT * 4)) + ((i >> 1) & 1)];
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

/* ---- cp.async ---- */

__device__ __forceinline__ unsigned int pk_smem_addr(const void* p)
{
    return (unsigned int)__cvta_generic_to_shared(p);
}

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
