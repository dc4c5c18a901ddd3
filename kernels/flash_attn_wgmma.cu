/* flash_attn_wgmma.cu: bf16/fp16 joint attention on Hopper tensor cores (pictor-diffusers).

   Algorithm: flash-attention forward, non-causal (key padding in the
   WG_KEY_LENS=1 build), online softmax in the exp2 domain (scale * log2(e)
   folded into one FFMA), f32 accumulators and f32 softmax state.
   Warp-specialised, after FlashAttention-3:
     * warpgroup 0 is the producer: it first gives up most of its registers
       (setmaxnreg) to the consumers, then one thread issues bulk tensor
       copies (TMA) of the Q tile once and of K/V tiles into a WG_STAGES-deep
       ring, each completing on an mbarrier. K and V of a stage are freed apart (K
       as soon as S is computed, V after P.V), so loads run up to
       WG_STAGES tiles ahead;
     * warpgroups 1 and 2 are consumers, 64 query rows each. Per key tile j they
       issue S_j = Q K_j^T (wgmma, both operands in shared memory) and
       O += P_{j-1} V_{j-1} (wgmma, P from registers) back to back, then run
       tile j's softmax while the P.V product is still in flight, so the
       exponentials overlap the tensor cores.
   Two builds. WG_PERSISTENT=1 (the host runs it on short key sequences):
   each block loops over work tiles (128 query rows of one head and batch),
   and the K/V ring runs on from one work tile to the next, so the next tile's
   keys and its Q tile load while the last P.V and the store of the current
   one run (Q is reloaded once both consumers' S products are done).
   WG_PERSISTENT=0: one block per work tile, which the hardware schedules
   (measured faster on long key sequences).
   The producer, the ring and the roles are sm90_pipeline.cuh's, the products
   sm90_wgmma.cuh's; this file holds the tile copies, the schedule, the main
   loop and the store.

   Launch geometry (WG_D, WG_IN_KIND, WG_BQ, WG_BK, WG_STAGES, WG_THREADS and
   WG_SMEM_BYTES come from the host as -D; static_asserts below check them
   against this kernel's own formulas; WG_STAGES is the one free choice):
       grid  = WG_PERSISTENT=1: (min(work tiles, SMs), 1, 1), work tiles =
               ceil(seq_q / WG_BQ) x num_heads x batch, WG_BQ = 128 query
               rows; block b takes tiles b, b + gridDim.x, ... (query block
               fastest, then head); WG_PERSISTENT=0: (ceil(seq_q / WG_BQ),
               num_heads, batch), one work tile per block
       block = WG_THREADS = 384 = 3 warpgroups (producer, 2 consumers), one
               block per SM at a time
       dynamic shared memory = WG_SMEM_BYTES = 230,512 bytes at WG_D = 128 and
       WG_STAGES = 3 (224 KiB of tiles, 1 KiB of alignment slack, 112 bytes of
       mbarriers; 115,824 bytes at WG_D = 64):
           Q tile, WG_STAGES x (K tile, V tile), 128 x WG_D 16-bit each, stored
           as WG_D / 64 slabs of 64 columns, 128-byte rows in TMA's 128-byte
           swizzle; then the mbarriers.
   Matrix products: wgmma.mma_async, f32 accumulators; m64n128k16 for S and
   m64n{WG_D}k16 for O.
       S = Q K^T : A = Q slab rows (K-major), B = K slab rows (K-major).
       O += P V  : A = P, packed to 16 bits from the S accumulators (their
                   layout is the A-fragment layout); B = V read transposed
                   (MN-major descriptor: the 64-column slabs are LBO apart).

   Layout:
       q, k, v : 16-bit [batch][num_heads][rows][WG_D] with any strides the
                 host can encode (each a multiple of 16 bytes, head_dim
                 contiguous): head-major [B, H, N, D] or the token-major
                 [B, N, H, D] diffusers' dispatcher passes, read in place.
                 Three rank-4 tensor maps of a window of rows (dims WG_D,
                 num_heads, seq_q or seq_k, batch; box 64 x 1 x 128 x 1;
                 128-byte swizzle); rows past the window are zero-filled by
                 the copy engine, and keys >= seq_k masked
       out     : token-major [batch, out_pitch, num_heads * WG_D], same dtype,
                 offset by the host to the window's first row
       lse     : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null, read by the WG_KEY_LENS=1 build only:
                 batch b attends its first key_lens[b] keys (attention_io.cuh)
       batch   : the last argument, B (the persistent build's work tiles)
   Precision: 16-bit inputs (WG_IN_KIND 1: bfloat16, 2: float16), f32 products
   and softmax; P is rounded to the input dtype for the P.V product (as in
   FlashAttention); the output is rounded once, to nearest even. WG_D is 64
   or 128. Needs sm_90a. */

#include "attention_io.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_wgmma.cuh"
#include "softmax.cuh"

#if !defined(WG_D) || !defined(WG_IN_KIND) || !defined(WG_BQ) || !defined(WG_BK) || !defined(WG_STAGES) \
    || !defined(WG_THREADS) || !defined(WG_SMEM_BYTES)
#error "flash_attn_wgmma.cu needs -D WG_D, WG_IN_KIND, WG_BQ, WG_BK, WG_STAGES, WG_THREADS, WG_SMEM_BYTES from the host"
#endif
#if !defined(WG_KEY_LENS) || !defined(WG_PERSISTENT)
#error "flash_attn_wgmma.cu needs -D WG_KEY_LENS=0 or 1 and WG_PERSISTENT=0 or 1 from the host"
#endif
#if WG_D != 64 && WG_D != 128
#error "the wgmma kernel is built for head_dim 64 or 128"
#endif
#if WG_IN_KIND != 1 && WG_IN_KIND != 2
#error "WG_IN_KIND must be 1 (bfloat16) or 2 (float16)"
#endif

#define WG_SLABS (WG_D / 64)                 /* 64-column slabs per 128-row tile */
#define WG_SLAB_BYTES (128 * 128)            /* 128 rows x 64 columns x 2 bytes */
#define WG_TILE_BYTES (WG_SLABS * WG_SLAB_BYTES)    /* 128 rows x WG_D columns */
#define WG_O_REGS (WG_D / 2)                 /* a consumer thread's output accumulators */
#define WG_BARRIER_BYTES (8 * (2 + 4 * WG_STAGES))   /* the ring's, then q_free */
static_assert(WG_BQ == 128 && WG_BK == 128,
              "WG_BQ and WG_BK must be 128: the kernel is written for 128 x 128 tiles");
static_assert(WG_THREADS == PK_THREADS,
              "WG_THREADS must be 384: one producer and two consumer warpgroups");
static_assert(WG_STAGES >= 1, "WG_STAGES: at least one K/V stage");
static_assert(WG_SMEM_BYTES == 1024 + (1 + 2 * WG_STAGES) * WG_TILE_BYTES + WG_BARRIER_BYTES,
              "WG_SMEM_BYTES disagrees with the kernel's Q | K stages | V stages | mbarriers");
static_assert(WG_SMEM_BYTES <= 227 * 1024, "WG_SMEM_BYTES exceeds sm_90's 227 KiB per block");

/* Every slab of a 128 x WG_D tile, completing on `bar`. */
__device__ __forceinline__ void wg_copy_tile(unsigned int dst, const pk_tensor_map* map, int row, int head,
                                             int batch, unsigned int bar)
{
    pk_bar_expect_bytes(bar, WG_TILE_BYTES);
    #pragma unroll
    for (int slab = 0; slab < WG_SLABS; slab++) {
        pk_copy_box(dst + slab * WG_SLAB_BYTES, map, 64 * slab, head, row, batch, bar);
    }
}

/* ---- wgmma ---- */

/* S = Q K^T for one warpgroup: WG_D / 16 k-steps of 16 columns, 4 per slab. */
__device__ __forceinline__ void wg_issue_qk(float* s, unsigned int q_rows, unsigned int k_tile)
{
    const unsigned long long a = pk_wgmma_desc(q_rows, 16, 1024), b = pk_wgmma_desc(k_tile, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < WG_D / 16; kk++) {
        const unsigned int offset = (kk / 4) * WG_SLAB_BYTES + (kk % 4) * 32;
        pk_wgmma_n128_ss<WG_IN_KIND>(s, pk_desc_advance(a, offset), pk_desc_advance(b, offset), kk > 0);
    }
    pk_wgmma_commit();
}

/* O += P V: 8 k-steps of 16 keys; V's 64-column slabs (two at head_dim 128) are LBO apart. */
__device__ __forceinline__ void wg_issue_pv(float* o, const unsigned int* p, unsigned int v_tile)
{
    const unsigned long long b = pk_wgmma_desc(v_tile, WG_SLAB_BYTES, 1024);
    #pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++) {
        const unsigned long long b_kk = pk_desc_advance(b, kk * 16 * 128);
        if constexpr (WG_D == 128) {
            pk_wgmma_n128_rs<WG_IN_KIND>(o, p + 4 * kk, b_kk, 1);
        } else {
            pk_wgmma_n64_rs<WG_IN_KIND>(o, p + 4 * kk, b_kk, 1);
        }
    }
    pk_wgmma_commit();
}

/* P as the A operand of the next P.V: register 4kk + c holds keys 16kk.. of
   the layout wgmma expects, which is S's accumulator order pairwise. */
__device__ __forceinline__ void wg_pack_p(unsigned int* p, const float* s)
{
    #pragma unroll
    for (int i = 0; i < 32; i++) p[i] = pk_pack2<WG_IN_KIND>(s[2 * i], s[2 * i + 1]);
}

/* ---- roles ---- */

/* Shared-memory map: Q tile, K tiles, V tiles (1024-byte aligned for the
   swizzle), then the ring's mbarriers q_full, k_full[], v_full[], k_free[], v_free[] and
   q_free (the consumers are done with the Q tile). Stage addresses are computed, not
   indexed, so nothing lands in local memory. */
struct wg_smem : pk_ring<WG_STAGES> {
    unsigned int base;
    __device__ unsigned int q() const { return base; }
    __device__ unsigned int k(unsigned int s) const { return base + (1 + s) * WG_TILE_BYTES; }
    __device__ unsigned int v(unsigned int s) const { return base + (1 + WG_STAGES + s) * WG_TILE_BYTES; }
    __device__ unsigned int q_free() const { return bars + 8 * (1 + 4 * WG_STAGES); }
};

__device__ __forceinline__ wg_smem wg_carve(unsigned char* raw)
{
    wg_smem m;
    m.base = pk_smem_base(raw);
    m.bars = m.base + (1 + 2 * WG_STAGES) * WG_TILE_BYTES;
    return m;
}

/* One work tile: WG_BQ query rows from q0 of head `head` in batch `batch`, over that batch's seq_k keys
   (n_tiles key tiles; 0 when the batch has none). */
struct wg_work {
    unsigned int q0, head, batch, seq_k, n_tiles;
};

/* The launch's work tiles, numbered query block fastest, then head, then batch: the blocks running at once
   share heads, so K and V come from L2. The persistent build's block b takes tiles b, b + gridDim.x, ...;
   the other build's block takes its own, (blockIdx.x, blockIdx.y, blockIdx.z). */
struct wg_schedule {
    unsigned int q_blocks, num_heads, seq_k, n_work;
    const int* key_lens;

    __device__ wg_work tile(unsigned int q_block, unsigned int head, unsigned int batch) const
    {
        wg_work t;
        t.q0 = q_block * WG_BQ;
        t.head = head;
        t.batch = batch;
        t.seq_k = WG_KEY_LENS ? pk_keys_of(key_lens, batch, seq_k) : seq_k;
        t.n_tiles = (t.seq_k + WG_BK - 1) / WG_BK;
        return t;
    }
    __device__ wg_work at(unsigned int w) const
    {
        return tile(w % q_blocks, (w / q_blocks) % num_heads, w / q_blocks / num_heads);
    }
    __device__ wg_work own() const { return tile(blockIdx.x, blockIdx.y, blockIdx.z); }
};

/* The producer's share of one work tile with keys: its Q tile (once the consumers freed the last one, in
   the persistent build), then its key tiles through the ring from the ring's tile `first`. */
__device__ __forceinline__ void wg_produce_tile(const wg_smem& m, const pk_tensor_map* tm_q,
                                                const pk_tensor_map* tm_k, const pk_tensor_map* tm_v,
                                                const wg_work& t, unsigned int first, unsigned int round)
{
    if (WG_PERSISTENT && round > 0) pk_bar_wait(m.q_free(), (round - 1) & 1);
    wg_copy_tile(m.q(), tm_q, (int)t.q0, (int)t.head, (int)t.batch, m.q_full());
    m.produce(
        t.n_tiles,
        [&](unsigned int j, unsigned int s) {
            wg_copy_tile(m.k(s), tm_k, j * WG_BK, (int)t.head, (int)t.batch, m.k_full(s));
        },
        [&](unsigned int j, unsigned int s) {
            wg_copy_tile(m.v(s), tm_v, j * WG_BK, (int)t.head, (int)t.batch, m.v_full(s));
        },
        first);
}

/* The producer thread: each work tile with keys, the ring running on across them (persistent build). */
__device__ __forceinline__ void wg_produce(const wg_smem& m, const pk_tensor_map* tm_q, const pk_tensor_map* tm_k,
                                           const pk_tensor_map* tm_v, const wg_schedule& sched)
{
#if WG_PERSISTENT
    unsigned int first = 0, round = 0;
    for (unsigned int w = blockIdx.x; w < sched.n_work; w += gridDim.x) {
        const wg_work t = sched.at(w);
        if (WG_KEY_LENS && t.n_tiles == 0) continue;
        wg_produce_tile(m, tm_q, tm_k, tm_v, t, first, round);
        first += t.n_tiles;
        round++;
    }
#else
    const wg_work t = sched.own();
    if (!WG_KEY_LENS || t.n_tiles != 0) wg_produce_tile(m, tm_q, tm_k, tm_v, t, 0, 0);
#endif
}

/* One consumer warpgroup's 64 rows of work tile `wk`: its key tiles are the ring's first .. first +
   n_tiles - 1, its Q tile the ring's round `round`. */
__device__ __forceinline__ void wg_attend(const wg_smem& m, const wg_work& wk, unsigned int first, unsigned int round,
                                          unsigned short* __restrict__ out, float* __restrict__ lse,
                                          unsigned int num_heads, unsigned int seq_q, unsigned int out_pitch,
                                          float scale_log2)
{
    const unsigned int rows0 = (threadIdx.x / 128 - 1) * 64;   /* this warpgroup's first row in the tile */
    const unsigned int warp = (threadIdx.x / 32) & 3u;
    const unsigned int g = (threadIdx.x & 31u) >> 2;
    const unsigned int t = threadIdx.x & 3u;
    const unsigned int q_rows = m.q() + rows0 * 128;               /* 128-byte rows in each slab */
    const unsigned int seq_k = wk.seq_k, n_tiles = wk.n_tiles;

    float o[WG_O_REGS], s[64], corr[2];
    unsigned int p[32];
    float m_run[2] = {PK_NEG_INF, PK_NEG_INF};
    float l_run[2] = {0.f, 0.f};
    #pragma unroll
    for (int i = 0; i < WG_O_REGS; i++) o[i] = 0.f;

    m.wait_q(round);
    m.wait_k(first % WG_STAGES, first);
    pk_wgmma_fence();
    wg_issue_qk(s, q_rows, m.k(first % WG_STAGES));
    pk_wgmma_wait<0>();
    pk_pin<64>(s);
    m.free_k(first % WG_STAGES);
    pk_mask_tail<WG_BK / 8>(s, 0, seq_k, t);
    pk_online_softmax<WG_BK / 8, 1, true>(s, m_run, l_run, corr, scale_log2);
    wg_pack_p(p, s);

    for (unsigned int j = 1; j < n_tiles; j++) {
        const unsigned int c = first + j, st = c % WG_STAGES, prev = (c - 1) % WG_STAGES;
        m.wait_k(st, c);
        m.wait_v(prev, c - 1);
        pk_pin<64>(s);
        pk_pin<WG_O_REGS>(o);
        pk_wgmma_fence();
        wg_issue_qk(s, q_rows, m.k(st));
        wg_issue_pv(o, p, m.v(prev));
        pk_wgmma_wait<1>();
        pk_pin<64>(s);
        m.free_k(st);
        pk_mask_tail<WG_BK / 8>(s, j * WG_BK, seq_k, t);
        pk_online_softmax<WG_BK / 8, 1, true>(s, m_run, l_run, corr, scale_log2);
        pk_wgmma_wait<0>();
        pk_pin<WG_O_REGS>(o);
        m.free_v(prev);
        pk_rescale<WG_D / 8>(o, corr);
        wg_pack_p(p, s);
    }
    if (WG_PERSISTENT) pk_warp_arrive(m.q_free());   /* every S product of this tile is done: Q may reload */
    const unsigned int last = first + n_tiles - 1;
    m.wait_v(last % WG_STAGES, last);
    pk_pin<WG_O_REGS>(o);
    pk_wgmma_fence();
    wg_issue_pv(o, p, m.v(last % WG_STAGES));
    pk_wgmma_wait<0>();
    pk_pin<WG_O_REGS>(o);
    if (WG_PERSISTENT) m.free_v(last % WG_STAGES);   /* the ring runs on into the next work tile */

    const unsigned long long inner = (unsigned long long)num_heads * WG_D;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const float l = pk_quad_sum(l_run[r]);
        const unsigned int row = wk.q0 + rows0 + warp * 16 + g + 8 * r;
        if (row >= seq_q) continue;
        const float inv = 1.f / l;
        const unsigned long long token = (unsigned long long)wk.batch * out_pitch + row;
        unsigned short* dst = out + token * inner + (unsigned long long)wk.head * WG_D + 2 * t;
        if (t == 0) pk_store_lse(lse, token * num_heads + wk.head, m_run[r], l);
        #pragma unroll
        for (int n = 0; n < WG_D / 8; n++) {
            pk_store2<WG_IN_KIND>(dst + 8 * n, o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
        }
    }
}

/* The consumer warpgroups: each work tile in the producer's order; a tile whose batch has no keys gets
   rows of 0 and LSE -inf (attention_io.cuh) and takes nothing from the ring. */
__device__ __forceinline__ void wg_consume_tile(const wg_smem& m, const wg_work& t, unsigned int first,
                                                unsigned int round, unsigned short* __restrict__ out,
                                                float* __restrict__ lse, unsigned int num_heads, unsigned int seq_q,
                                                unsigned int out_pitch, float scale_log2)
{
    if (WG_KEY_LENS && t.n_tiles == 0) {   /* without key counts every tile has keys (seq_k >= 1) */
        pk_store_keyless_tile<WG_IN_KIND>(out, lse, t.q0, WG_BQ, t.head, t.batch, seq_q, num_heads, WG_D, out_pitch,
                                          threadIdx.x - 128, WG_THREADS - 128);
    } else {
        wg_attend(m, t, first, round, out, lse, num_heads, seq_q, out_pitch, scale_log2);
    }
}

__device__ __forceinline__ void wg_consume(const wg_smem& m, const wg_schedule& sched, unsigned short* __restrict__ out,
                                           float* __restrict__ lse, unsigned int seq_q, unsigned int out_pitch,
                                           float scale_log2)
{
#if WG_PERSISTENT
    unsigned int first = 0, round = 0;
    for (unsigned int w = blockIdx.x; w < sched.n_work; w += gridDim.x) {
        const wg_work t = sched.at(w);
        wg_consume_tile(m, t, first, round, out, lse, sched.num_heads, seq_q, out_pitch, scale_log2);
        first += t.n_tiles;
        round += t.n_tiles != 0;
    }
#else
    wg_consume_tile(m, sched.own(), 0, 0, out, lse, sched.num_heads, seq_q, out_pitch, scale_log2);
#endif
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
joint_attention_wgmma(
    PK_MAP_OPERANDS(unsigned short),
    PK_MAP_SCALARS,
    float scale_log2, unsigned int batch)
{
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    const wg_smem m = wg_carve(wg_smem_raw);
    const unsigned int q_blocks = (seq_q + WG_BQ - 1) / WG_BQ;
    const wg_schedule sched = {q_blocks, num_heads, seq_k, q_blocks * num_heads * batch, key_lens};
    if (WG_PERSISTENT && threadIdx.x == 0) pk_bar_init(m.q_free(), PK_CONSUMER_WARPS);   /* run() fences it */
    m.run([&] { wg_produce(m, &tm_q, &tm_k, &tm_v, sched); },
          [&] { wg_consume(m, sched, out, lse, seq_q, out_pitch, scale_log2); });
}
