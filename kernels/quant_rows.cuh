/* quant_rows.cuh: 16-bit rows to int8 codes, for the 8-bit kernels' prepass (quantize_qkv8.cu), sm_80+.

   A thread holds eight channels (one 16-byte word) of eight rows of a plane, row0 + step u; KIND is the
   rows' dtype (1 bfloat16, 2 float16), D the row length. Maxima keep NaN (max.NaN, which fmaxf would drop),
   so a NaN input reaches its scale and the kernels' outputs there are NaN, as torch's.
     pk_max_nan          max(a, b), NaN where either is
     pk_half_to_float    one 16-bit value as f32
     pk_unpack8          one 16-byte word as eight f32
     pk_int8x8           eight f32 to int8 codes x * inv, packed
     pk_rows_absmax      a thread's eight rows loaded (kept packed), and their absmax
     pk_store_int8_rows  those rows' codes stored
     pk_block_max        a max over some warps of the block, through shared memory */

#ifndef PICTOR_QUANT_ROWS_CUH
#define PICTOR_QUANT_ROWS_CUH

__device__ __forceinline__ float pk_max_nan(float a, float b)
{
    float m;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
    return m;
}

template <int KIND>
__device__ __forceinline__ float pk_half_to_float(unsigned short bits)
{
    static_assert(KIND == 1 || KIND == 2, "pk_half_to_float: KIND 1 (bfloat16) or 2 (float16)");
    if constexpr (KIND == 1) {
        return __uint_as_float((unsigned int)bits << 16);
    } else {
        float x;
        asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
        return x;
    }
}

template <int KIND>
__device__ __forceinline__ void pk_unpack8(uint4 raw, float* x)
{
    const unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = pk_half_to_float<KIND>((unsigned short)(words[i] & 0xffffu));
        x[2 * i + 1] = pk_half_to_float<KIND>((unsigned short)(words[i] >> 16));
    }
}

/* Codes x * inv, nearest with ties to even, saturated at +-127, little-endian. */
__device__ __forceinline__ uint2 pk_int8x8(const float* x, float inv)
{
    unsigned int words[2] = {0u, 0u};
    #pragma unroll
    for (int e = 0; e < 8; e++) {
        const int code = max(-127, min(127, __float2int_rn(x[e] * inv)));
        words[e / 4] |= (unsigned int)(code & 0xff) << (8 * (e % 4));
    }
    return make_uint2(words[0], words[1]);
}

/* The words of channels 8 cg .. + 7 of rows row0 + step u (zero at rows >= count) into raw, all eight loads in
   flight before the first use; returns their absmax after subtracting `shift` (null: none) from each channel. */
template <int D, int KIND>
__device__ __forceinline__ float pk_rows_absmax(const unsigned short* plane_rows, unsigned int row0, unsigned int step,
                                                unsigned int count, unsigned int cg, const float* shift, uint4* raw)
{
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        const unsigned int row = row0 + step * u;
        raw[u] = row < count ? *(const uint4*)(plane_rows + (unsigned long long)row * D + 8 * cg)
                             : make_uint4(0u, 0u, 0u, 0u);
    }
    float amax = 0.f;
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        if (row0 + step * u >= count) continue;
        float x[8];
        pk_unpack8<KIND>(raw[u], x);
        #pragma unroll
        for (int e = 0; e < 8; e++) amax = pk_max_nan(amax, fabsf(shift == nullptr ? x[e] : x[e] - shift[8 * cg + e]));
    }
    return amax;
}

/* The int8 codes (x - shift) * inv[u] of those rows to dst, `[rows][D]` bytes (rows >= count skipped). */
template <int D, int KIND>
__device__ __forceinline__ void pk_store_int8_rows(unsigned char* dst, const uint4* raw, unsigned int row0,
                                                   unsigned int step, unsigned int count, unsigned int cg,
                                                   const float* shift, const float* inv)
{
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        const unsigned int row = row0 + step * u;
        if (row >= count) continue;
        float x[8];
        pk_unpack8<KIND>(raw[u], x);
        #pragma unroll
        for (int e = 0; e < 8; e++) x[e] = shift == nullptr ? x[e] : x[e] - shift[8 * cg + e];
        *(uint2*)(dst + (unsigned long long)row * D + 8 * cg) = pk_int8x8(x, inv[u]);
    }
}

/* Max of x (>= 0 or NaN) over the block's threads [first, first + 32 * warps), every thread calling; `red`:
   shared scratch of 8 floats. */
__device__ __forceinline__ float pk_block_max(float x, float* red, unsigned int first, unsigned int warps)
{
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = pk_max_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x / 32] = x;
    __syncthreads();
    float m = 0.f;
    for (unsigned int w = 0; w < warps; w++) m = pk_max_nan(m, red[first / 32 + w]);
    __syncthreads();
    return m;
}

#endif
