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
     LSE          pk_store_lse: the natural log-sum-exp of a row (optional output)
     Key lengths  pk_batch_keys, pk_store_keyless_rows, pk_no_keys: per-batch key counts
                  (key-padding masks, keys compacted to the front by the host)
     Dtypes       pk_storage<KIND>, pk_pack2<KIND>, pk_store2<KIND>, pk_store4<KIND>:
                  KIND 0 is f32, 1 bfloat16, 2 float16 (16-bit values travel
                  as raw bit patterns in unsigned short); f32 -> 16-bit rounds
                  to nearest even (cvt.rn)
     fp16 split   pk_split_exponent, pk_split2_f16: f32 -> scaled fp16 hi + lo
     cp.async     pk_smem_addr, pk_cp_async16, pk_cp_async16_zfill,
                  pk_cp_async_commit, pk_cp_async_wait_all
     Hopper       pk_tensor_map, pk_bar_* (mbarriers), pk_ring (the K/V
                  ring's mbarriers), pk_copy_box (TMA),
                  pk_wgmma_desc, pk_desc_advance, pk_wgmma_fence/commit/wait, pk_pin (sm_90a only; unused
                  helpers emit no code, so other targets compile this header)

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

/* ---- log-sum-exp output ---- */

/* lse[index] = ln(sum_j exp(scale * s_j)) of a row, from its final running max
   m (log2 units, scale applied) and running sum l >= 1: (m + log2 l) ln 2.
   Nothing is written when lse is null (the caller asked for no LSE). */
__device__ __forceinline__ void pk_store_lse(float* lse, unsigned long long index, float m_log2, float l)
{
    if (lse != nullptr) lse[index] = (m_log2 + log2f(l)) * 0.6931471805599453f;
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

/* ---- per-batch key lengths (key-padding masks) ---- */

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

/* ---- scaled fp16 hi/lo split (the fp16x3 parity kernels) ---- */

#define PK_SPLIT_TOP 15       /* a scale group's largest |x| is scaled into [2^14, 2^15) */
#define PK_SPLIT_MAX_EXP 120  /* scale exponents are clamped to +-120: 2^e and 2^-e stay normal f32 */

/* The exponent e of the power-of-two scale 2^e for a group whose largest |x| has
   the f32 bit pattern `max_bits`: 0 for an all-zero or non-finite group (whose
   results are zero or non-finite anyway). */
__device__ __forceinline__ int pk_split_exponent(unsigned int max_bits)
{
    const float m = __uint_as_float(max_bits);
    if (m == 0.f || !(m <= 3.4028235e38f)) return 0;
    int e;
    frexpf(m, &e);  /* m = f 2^e, f in [0.5, 1) */
    return max(-PK_SPLIT_MAX_EXP, min(PK_SPLIT_MAX_EXP, PK_SPLIT_TOP - e));
}

/* (hi, lo) float16 pairs of two f32 values a, b (already scaled): hi rounds to
   nearest even, lo is the rounded remainder, so hi + lo keeps 22 bits. */
__device__ __forceinline__ uint2 pk_split2_f16(float a, float b)
{
    const unsigned int hi = pk_pack2<2>(a, b);
    float ha, hb;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(ha), "=f"(hb) : "r"(hi));
    return make_uint2(hi, pk_pack2<2>(a - ha, b - hb));
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

/* ---- Hopper (sm_90a): mbarriers, bulk tensor copies (TMA), wgmma ---- */

/* CUtensorMap: 128 opaque bytes, encoded on the host by cuTensorMapEncodeTiled. */
struct __align__(64) pk_tensor_map {
    unsigned long long opaque[16];
};

__device__ __forceinline__ void pk_bar_init(unsigned int bar, unsigned int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void pk_bar_expect_bytes(unsigned int bar, unsigned int bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void pk_bar_arrive(unsigned int bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void pk_bar_wait(unsigned int bar, unsigned int parity)
{
    unsigned int done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

/* Copy the box at (column, head, row, batch) of a rank-4 map (dims head_dim, heads,
   rows, batches, strided as the host encoded them: head-major or token-major) into
   shared memory at dst, completing on `bar` (which must expect the box's bytes). */
__device__ __forceinline__ void pk_copy_box(unsigned int dst, const pk_tensor_map* map, int column, int head, int row,
                                            int batch, unsigned int bar)
{
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(dst), "l"((unsigned long long)map), "r"(column), "r"(head), "r"(row), "r"(batch), "r"(bar)
        : "memory");
}

/* One arrival on `bar` for the calling warp (lane 0 arrives). */
__device__ __forceinline__ void pk_warp_arrive(unsigned int bar)
{
    if ((threadIdx.x & 31u) == 0) pk_bar_arrive(bar);
}

/* The warp-specialised kernels' mbarriers at `bars`, 8 bytes each: q_full, then k_full[STAGES],
   v_full[STAGES] (one arrival each: the producer's expect-bytes), k_free[STAGES], v_free[STAGES] (one
   arrival per consumer warp). Each kernel's shared-memory layout derives from it and sets `bars`;
   init: thread 0 initialises them, then the whole block synchronises. */
template <int STAGES>
struct pk_ring {
    unsigned int bars;
    __device__ unsigned int q_full() const { return bars; }
    __device__ unsigned int k_full(unsigned int s) const { return bars + 8 * (1 + s); }
    __device__ unsigned int v_full(unsigned int s) const { return bars + 8 * (1 + STAGES + s); }
    __device__ unsigned int k_free(unsigned int s) const { return bars + 8 * (1 + 2 * STAGES + s); }
    __device__ unsigned int v_free(unsigned int s) const { return bars + 8 * (1 + 3 * STAGES + s); }

    template <int CONSUMER_WARPS>
    __device__ void init() const
    {
        if (threadIdx.x == 0) {
            pk_bar_init(q_full(), 1);
            #pragma unroll
            for (int s = 0; s < STAGES; s++) {
                pk_bar_init(k_full(s), 1);
                pk_bar_init(v_full(s), 1);
                pk_bar_init(k_free(s), CONSUMER_WARPS);
                pk_bar_init(v_free(s), CONSUMER_WARPS);
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }
};

/* The warp-specialised kernels' roles: warpgroup 0 gives registers away (setmaxnreg to 24) and its
   thread 0 runs `produce` (the TMA copies); the consumer warpgroups take them (240) and run `consume`. */
template <typename Produce, typename Consume>
__device__ __forceinline__ void pk_specialise(Produce produce, Consume consume)
{
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory");
        if (threadIdx.x == 0) produce();
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 240;" ::: "memory");
        consume();
    }
}

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
__device__ __forceinline__ void pk_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }

/* acc[0..63] (+)= A B for one warpgroup, m64n128k16 with f32 accumulators:
   A (64 x 16) from registers in the wgmma A-fragment layout, B (16 x 128) from
   shared memory, MN-major (transposed); KIND 1 bfloat16, 2 float16. */
#define PK_ACC64                                                                                  \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                     \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define PK_F8(a, i) "+f"(a[i]), "+f"(a[i + 1]), "+f"(a[i + 2]), "+f"(a[i + 3]), \
                    "+f"(a[i + 4]), "+f"(a[i + 5]), "+f"(a[i + 6]), "+f"(a[i + 7])
#define PK_F64(a) PK_F8(a, 0), PK_F8(a, 8), PK_F8(a, 16), PK_F8(a, 24), \
                  PK_F8(a, 32), PK_F8(a, 40), PK_F8(a, 48), PK_F8(a, 56)

template <int KIND>
__device__ __forceinline__ void pk_wgmma_n128_rs(float* acc, const unsigned int* a, unsigned long long b,
                                                 int accumulate)
{
    static_assert(KIND == 1 || KIND == 2, "pk_wgmma_n128_rs: KIND 1 (bfloat16) or 2 (float16)");
    if constexpr (KIND == 1) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " PK_ACC64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : PK_F64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " PK_ACC64
            ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
            : PK_F64(acc) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    }
}

/* Pin N accumulators at this point of the program: the compiler must not move
   their uses above a wgmma wait, nor their definitions below a wgmma issue. */
template <int N>
__device__ __forceinline__ void pk_pin(float* acc)
{
    #pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i]) :: "memory");
}

#endif
