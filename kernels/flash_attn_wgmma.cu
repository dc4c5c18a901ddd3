/* flash_attn_wgmma.cu: bf16/fp16 joint attention on Hopper tensor cores (pictor-diffusers).

   Algorithm: flash-attention forward, non-causal, online softmax in the exp2 domain (scale log2 e folded
   into one FFMA), f32 accumulators and softmax state. Warp-specialised, after FlashAttention-3: warpgroup 0
   gives up its registers (setmaxnreg 24) and one of its threads streams Q once and K/V tiles by TMA into a
   WG_STAGES-deep ring of mbarrier-guarded stages (K and V freed apart, so loads run ahead); warpgroups
   1 .. WG_CONSUMERS = WG_BQ / 64 consume, 64 query rows each (two at head_dim 128, 240 registers; three at
   64, 160, so the tensor cores stay busy through the others' softmax). Per key tile j they issue
   S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, then tile j's softmax; ptxas (13.0, NVRTC 12.9)
   places the P.V wait before that softmax, so a warpgroup's exponentials overlap the other warpgroups'
   products, not its own.
   Builds: WG_PERSISTENT=1 (short key sequences): each block loops over work tiles (WG_BQ query rows of one
   head and batch), the ring running on across them and Q double-buffered; the next tile's first S is
   issued with the previous tile's last P.V, whose rows are then rounded (epilogue.cuh) and stored.
   WG_PERSISTENT=0: one block per work tile, 176-key tiles at head_dim 128. WG_KEY_LENS=1: key padding as
   per-batch key counts (attention_io.cuh). WG_KEY_BIAS=1: an additive bias per key (SDPA's float mask over
   keys, key_bias.cuh), copied beside each K tile and added to S before the softmax. Stores: a consumer
   warpgroup stages its rounded rows by stmatrix and writes them by TMA (sm90_store.cuh), through an output
   tile of its own (persistent) or the work tile's Q tile (read for the last time by then).

   Launch geometry (-D WG_D, WG_IN_KIND, WG_BQ, WG_BK, WG_STAGES, WG_THREADS, WG_SMEM_BYTES, WG_KEY_LENS,
   WG_PERSISTENT, WG_KEY_BIAS from the host; static_asserts check them):
       grid  = persistent: (min(work tiles, SMs), 1, 1), work tiles = ceil(seq_q / WG_BQ) x heads x batch,
               block b taking tiles b, b + gridDim.x, ... (query block fastest, then head);
               else (ceil(seq_q / WG_BQ), num_heads, batch)
       block = WG_THREADS = 128 (1 + WG_CONSUMERS): 384 at head_dim 128 (WG_BQ 128), 512 at 64 (WG_BQ 192)
       dynamic shared memory = WG_SMEM_BYTES: 1 KiB alignment slack, 1 + WG_PERSISTENT Q tiles (WG_BQ x WG_D),
               WG_STAGES K and V tiles (WG_BK x WG_D), WG_PERSISTENT output tiles, 16-bit, as 64-column slabs
               of 128-byte rows in TMA's 128-byte swizzle; WG_KEY_BIAS: WG_STAGES rows of WG_BK f32 biases
               (each padded to 128 bytes);
               8 (4 + 4 WG_STAGES) bytes of mbarriers. Head_dim 128: 214,112 bytes (one block per tile, 2
               stages of 176 keys), 230,496 (persistent, 2 of 128); head_dim 64, 128-key tiles: 156,832
               (4 stages), 173,184 (persistent, 3); a key bias adds WG_STAGES WG_BIAS_ROW.
   Matrix products: wgmma m64n{WG_BK}k16 for S (A = Q, B = K, both K-major in shared memory) and
   m64n{WG_D}k16 for O (A = P packed to 16 bits from the S accumulators, B = V through an MN-major
   descriptor), f32 accumulators.
   Layout:
       q, k, v : 16-bit [batch][num_heads][rows][WG_D], any strides the host can encode (head-major
                 [B, H, N, D] or the dispatcher's token-major [B, N, H, D], read in place): rank-4 tensor maps
                 of a window of rows (box 64 x 1 x WG_BQ or WG_BK x 1, 128-byte swizzle); rows past the
                 window are zero-filled, keys >= seq_k masked
       out     : token-major [batch, out_pitch, num_heads * WG_D], the input dtype, at the window's first row,
                 written through tm_o (box 64 x 1 x 64 x 1); the pointer serves batches without keys
       lse     : [batch, out_pitch, num_heads] f32 natural log-sum-exp, or null
       key_lens: [batch] i32 or null (WG_KEY_LENS=1): batch b attends its first key_lens[b] keys
       key_bias: f32 [batch * num_heads][WG_BK ceil(seq_k / WG_BK)] in log2 units (WG_KEY_BIAS=1), read through
                 tm_b (2-D, box WG_BK x 1, no swizzle); else tm_b is unread
       batch   : the last argument, B (the persistent build's work tiles)
   Precision: 16-bit inputs (WG_IN_KIND 1 bfloat16, 2 float16), f32 products and softmax; P rounded to the
   input dtype for P.V (as FlashAttention does); the output rounded once, to nearest even. Rows whose keys all
   have bias -inf get 0 and LSE -inf. Needs sm_90a. */

#include "attention_io.cuh"
#include "epilogue.cuh"
#include "key_bias.cuh"
#include "sm90_pipeline.cuh"
#include "sm90_store.cuh"
#include "sm90_wgmma.cuh"
#include "softmax.cuh"
#include "tile_schedule.cuh"

#if !defined(WG_D) || !defined(WG_IN_KIND) || !defined(WG_BQ) || !defined(WG_BK) || !defined(WG_STAGES) \
    || !defined(WG_THREADS) || !defined(WG_SMEM_BYTES)
#error "flash_attn_wgmma.cu needs -D WG_D, WG_IN_KIND, WG_BQ, WG_BK, WG_STAGES, WG_THREADS, WG_SMEM_BYTES from the host"
#endif
#if !defined(WG_KEY_LENS) || !defined(WG_PERSISTENT) || !defined(WG_KEY_BIAS)
#error "flash_attn_wgmma.cu needs -D WG_KEY_LENS, WG_PERSISTENT and WG_KEY_BIAS (each 0 or 1) from the host"
#endif
#if WG_D != 64 && WG_D != 128
#error "the wgmma kernel is built for head_dim 64 or 128"
#endif
#if WG_IN_KIND != 1 && WG_IN_KIND != 2
#error "WG_IN_KIND must be 1 (bfloat16) or 2 (float16)"
#endif

#define WG_CONSUMERS (WG_BQ / 64)            /* consumer warpgroups, 64 query rows each */
#define WG_SLABS (WG_D / 64)                 /* 64-column slabs per tile, rows x 128 bytes each */
#define WG_Q_BYTES (WG_SLABS * WG_BQ * 128)  /* a Q (or output) tile: WG_BQ rows x WG_D columns */
#define WG_KV_BYTES (WG_SLABS * WG_BK * 128) /* a K or V tile: WG_BK rows x WG_D columns */
#define WG_O_REGS (WG_D / 2)                 /* a consumer thread's output accumulators */
#define WG_S_REGS (WG_BK / 2)                /* its scores of a key tile (P: half as many registers) */
#define WG_Q_BUFS (1 + WG_PERSISTENT)        /* Q tiles: the persistent build loads the next work tile's early */
#define WG_O_BUFS WG_PERSISTENT              /* output tiles: the persistent build's own staging area */
#define WG_K0 (WG_Q_BUFS * WG_Q_BYTES)       /* where the K tiles start, after the Q tiles */
#define WG_BIAS_ROW ((WG_BK * 4 + 127) / 128 * 128)   /* a stage's row of f32 key biases, 128-byte aligned */
#define WG_BIAS_BYTES (WG_KEY_BIAS * WG_STAGES * WG_BIAS_ROW)
#define WG_BARRIER_BYTES (8 * (4 + 4 * WG_STAGES))   /* the ring's, q_full of Q tile 1, q_free of both */
static_assert(WG_BQ == 128 || WG_BQ == 192, "WG_BQ must be 128 or 192 (two or three consumer warpgroups)");
static_assert(WG_BK == 128 || (WG_BK == 176 && WG_CONSUMERS == 2),
              "WG_BK must be 128, or 176 with two consumer warpgroups (their 240 registers hold 88 scores and 44 P)");
static_assert(WG_THREADS == 128 * (1 + WG_CONSUMERS),
              "WG_THREADS must be 128 x (1 + WG_BQ / 64): one producer and the consumer warpgroups");
static_assert(WG_STAGES >= 1, "WG_STAGES: at least one K/V stage");
static_assert(!WG_KEY_BIAS || !WG_KEY_LENS, "key biases come without key counts");
static_assert(WG_SMEM_BYTES == 1024 + WG_K0 + 2 * WG_STAGES * WG_KV_BYTES + WG_O_BUFS * WG_Q_BYTES + WG_BIAS_BYTES
                                   + WG_BARRIER_BYTES,
              "WG_SMEM_BYTES disagrees with the kernel's Q tiles | K | V stages | output tile | biases | mbarriers");
static_assert(WG_SMEM_BYTES <= 227 * 1024, "WG_SMEM_BYTES exceeds sm_90's 227 KiB per block");

/* ---- roles ---- */

/* Shared-memory map: WG_Q_BUFS Q tiles, K tiles, V tiles, WG_O_BUFS output tiles (1024-byte aligned for
   the swizzle), the stages' key biases (WG_KEY_BIAS), then the ring's mbarriers (q_full is Q tile 0's), Q tile 1's full mbarrier and both Q
   tiles' free ones (the consumers are done with the tile). Work tile `round` uses Q tile round % WG_Q_BUFS,
   in that tile's phase round / WG_Q_BUFS. Addresses are computed, not indexed, so nothing lands in local
   memory. */
struct wg_smem : pk_ring<WG_STAGES, WG_CONSUMERS> {
    unsigned int base;
    __device__ unsigned int q(unsigned int round) const { return base + (round % WG_Q_BUFS) * WG_Q_BYTES; }
    __device__ unsigned int k(unsigned int s) const { return base + WG_K0 + s * WG_KV_BYTES; }
    __device__ unsigned int v(unsigned int s) const { return base + WG_K0 + (WG_STAGES + s) * WG_KV_BYTES; }
    __device__ unsigned int o() const { return base + WG_K0 + 2 * WG_STAGES * WG_KV_BYTES; }
    __device__ unsigned int bias(unsigned int s) const { return o() + WG_O_BUFS * WG_Q_BYTES + s * WG_BIAS_ROW; }
    __device__ unsigned int q_full_of(unsigned int round) const
    {
        return round % WG_Q_BUFS ? bars + 8 * (1 + 4 * WG_STAGES) : q_full();
    }
    __device__ unsigned int q_free(unsigned int round) const
    {
        return bars + 8 * (2 + 4 * WG_STAGES + round % WG_Q_BUFS);
    }
    __device__ void wait_q_of(unsigned int round) const { pk_bar_wait(q_full_of(round), (round / WG_Q_BUFS) & 1); }
};

__device__ __forceinline__ wg_smem wg_carve(unsigned char* raw)
{
    wg_smem m;
    m.base = pk_smem_base(raw);
    m.bars = m.bias(0) + WG_BIAS_BYTES;
    return m;
}

typedef pk_tile_schedule<WG_BQ, WG_BK, WG_KEY_LENS> wg_schedule;

/* The producer's share of one work tile with keys: its Q tile (once the consumers freed that Q tile's
   previous work tile, in the persistent build), then its key tiles through the ring from the ring's tile
   `first`, each K tile with its biases (WG_KEY_BIAS: row `plane` of tm_b). */
__device__ __forceinline__ void wg_produce_tile(const wg_smem& m, const pk_tensor_map* tm_q,
                                                const pk_tensor_map* tm_k, const pk_tensor_map* tm_v,
                                                const pk_tensor_map* tm_b, const pk_work& t, int plane,
                                                unsigned int first, unsigned int round)
{
    if (WG_PERSISTENT && round >= WG_Q_BUFS) pk_bar_wait(m.q_free(round), (round / WG_Q_BUFS - 1) & 1);
    pk_copy_tile<WG_BQ, WG_SLABS>(m.q(round), tm_q, (int)t.q0, (int)t.head, (int)t.batch, m.q_full_of(round));
    m.produce(
        t.n_tiles,
        [&](unsigned int j, unsigned int s) {
            if (WG_KEY_BIAS) pk_copy_bias(m.bias(s), tm_b, j * WG_BK, plane, WG_BK * 4, m.k_full(s));
            pk_copy_tile<WG_BK, WG_SLABS>(m.k(s), tm_k, j * WG_BK, (int)t.head, (int)t.batch, m.k_full(s));
        },
        [&](unsigned int j, unsigned int s) {
            pk_copy_tile<WG_BK, WG_SLABS>(m.v(s), tm_v, j * WG_BK, (int)t.head, (int)t.batch, m.v_full(s));
        },
        first);
}

/* Work tile t's row of the key-bias map (WG_KEY_BIAS builds: one per batch and head). */
__device__ __forceinline__ int wg_bias_plane(const wg_schedule& sched, const pk_work& t)
{
    return (int)(t.batch * sched.num_heads + t.head);
}

/* The producer thread: each work tile with keys, the ring running on across them (persistent build). */
__device__ __forceinline__ void wg_produce(const wg_smem& m, const pk_tensor_map* tm_q, const pk_tensor_map* tm_k,
                                           const pk_tensor_map* tm_v, const pk_tensor_map* tm_b,
                                           const wg_schedule& sched)
{
#if WG_PERSISTENT
    unsigned int first = 0, round = 0;
    for (unsigned int w = blockIdx.x; w < sched.n_work; w += gridDim.x) {
        const pk_work t = sched.at(w);
        if (!sched.has_keys(t)) continue;
        wg_produce_tile(m, tm_q, tm_k, tm_v, tm_b, t, wg_bias_plane(sched, t), first, round);
        first += t.n_tiles;
        round++;
    }
#else
    const pk_work t = sched.own();
    if (sched.has_keys(t)) wg_produce_tile(m, tm_q, tm_k, tm_v, tm_b, t, wg_bias_plane(sched, t), 0, 0);
#endif
}

/* A consumer warpgroup's part of a work tile in flight: its 64 rows' output accumulators (o), the scores
   or probabilities of the latest key tile (s, and p: P packed for the next P.V), and the running softmax
   (two rows per thread). */
struct wg_acc {
    float o[WG_O_REGS], s[WG_S_REGS];
    unsigned int p[WG_S_REGS / 2];
    float m_run[2], l_run[2];
};

__device__ __forceinline__ unsigned int wg_rows0() { return pk_consumer_wg() * 64; }

/* Stage st's scores S (first key key0) to weights: its key biases added (WG_KEY_BIAS; S is then in log2
   units, and the stage's K is freed after they are read), keys >= seq_k masked, the online softmax step. */
__device__ __forceinline__ void wg_softmax(const wg_smem& m, float* s, float* m_run, float* l_run, float* corr,
                                           unsigned int st, unsigned int key0, unsigned int seq_k, float scale_log2)
{
    const unsigned int t = threadIdx.x & 3u;
    if (WG_KEY_BIAS) {
        pk_add_bias<WG_BK / 8>(s, m.bias(st), scale_log2, t);
        __syncwarp();   /* every lane's reads of the biases before lane 0 frees the stage */
    }
    m.free_k(st);
    pk_mask_tail<WG_BK / 8>(s, key0, seq_k, t);
    pk_online_softmax<WG_BK / 8, 1, true, WG_KEY_BIAS>(s, m_run, l_run, corr, WG_KEY_BIAS ? 1.f : scale_log2);
}

/* Key tile 0's S of work tile `wk` (the ring's tile `first`), computed and folded into a fresh softmax
   state (m_run, l_run); WITH_PV: the previous work tile's last P.V (V of the ring's tile first - 1) runs
   alongside it, into a.o, and is waited for after the softmax (in the source: see the opening comment). */
template <bool WITH_PV>
__device__ __forceinline__ void wg_first_keys(const wg_smem& m, wg_acc& a, float* m_run, float* l_run,
                                              const pk_work& wk, unsigned int first, unsigned int round,
                                              float scale_log2)
{
    const unsigned int st = first % WG_STAGES, prev = (first - 1) % WG_STAGES;
    float corr[2];
    m.wait_q_of(round);
    m.wait_k(st, first);
    if (WITH_PV) m.wait_v(prev, first - 1);
    pk_pin<WG_S_REGS>(a.s);
    if (WITH_PV) pk_pin<WG_O_REGS>(a.o);
    pk_wgmma_fence();
    pk_tile_qk<WG_IN_KIND, WG_D, WG_BQ, WG_BK>(a.s, m.q(round) + wg_rows0() * 128, m.k(st));
    if (WITH_PV) {
        pk_tile_pv<WG_IN_KIND, WG_D, WG_BK>(a.o, a.p, m.v(prev));
        pk_wgmma_wait<1>();
    } else {
        pk_wgmma_wait<0>();
    }
    pk_pin<WG_S_REGS>(a.s);
    m_run[0] = m_run[1] = PK_NEG_INF;
    l_run[0] = l_run[1] = 0.f;
    wg_softmax(m, a.s, m_run, l_run, corr, st, 0, wk.seq_k, scale_log2);
    if (WITH_PV) {
        pk_wgmma_wait<0>();
        pk_pin<WG_O_REGS>(a.o);
        m.free_v(prev);
    }
}

/* A warpgroup's rounded rows, through the WG_BQ-row tile at `area`, and their LSE. */
__device__ __forceinline__ void wg_store_rows(const pk_out_rows<WG_D>& r, unsigned int area, const pk_out_dst& dst)
{
    pk_store_tile<WG_D, WG_BQ>(r, area, dst.map);
    pk_write_lse<WG_D>(r, wg_rows0(), dst.lse, dst.num_heads, dst.seq_q, dst.out_pitch);
}

/* Key tile j of `wk`: S_j and P_{j-1} V_{j-1} issued back to back, then S_j's softmax, then the wait for the
   P.V product (which ptxas moves ahead of the softmax). */
__device__ __forceinline__ void wg_key_step(const wg_smem& m, wg_acc& a, const pk_work& wk, unsigned int first,
                                            unsigned int j, unsigned int q_rows, float scale_log2)
{
    const unsigned int c = first + j, st = c % WG_STAGES, prev = (c - 1) % WG_STAGES;
    float corr[2];
    m.wait_k(st, c);
    m.wait_v(prev, c - 1);
    pk_pin<WG_S_REGS>(a.s);
    pk_pin<WG_O_REGS>(a.o);
    pk_wgmma_fence();
    pk_tile_qk<WG_IN_KIND, WG_D, WG_BQ, WG_BK>(a.s, q_rows, m.k(st));
    pk_tile_pv<WG_IN_KIND, WG_D, WG_BK>(a.o, a.p, m.v(prev));
    pk_wgmma_wait<1>();
    pk_pin<WG_S_REGS>(a.s);
    wg_softmax(m, a.s, a.m_run, a.l_run, corr, st, j * WG_BK, wk.seq_k, scale_log2);
    pk_wgmma_wait<0>();
    pk_pin<WG_O_REGS>(a.o);
    m.free_v(prev);
    pk_rescale<WG_D / 8>(a.o, corr);
    pk_pack_p<WG_IN_KIND, WG_BK>(a.p, a.s);
}

/* Key tiles 1 .. n_tiles - 1 of `wk`. */
__device__ __forceinline__ void wg_key_loop(const wg_smem& m, wg_acc& a, const pk_work& wk, unsigned int first,
                                            unsigned int round, float scale_log2)
{
    const unsigned int q_rows = m.q(round) + wg_rows0() * 128;
    for (unsigned int j = 1; j < wk.n_tiles; j++) wg_key_step(m, a, wk, first, j, q_rows, scale_log2);
}

__device__ __forceinline__ void wg_zero_o(wg_acc& a)
{
    #pragma unroll
    for (int i = 0; i < WG_O_REGS; i++) a.o[i] = 0.f;
}

/* The last P.V of a work tile whose last key tile is the ring's tile `last`, then its store through the
   tile at `area`, drained before the block exits. */
__device__ __forceinline__ void wg_finish(const wg_smem& m, wg_acc& a, const pk_work& wk, unsigned int last,
                                          unsigned int area, const pk_out_dst& dst)
{
    m.wait_v(last % WG_STAGES, last);
    pk_pin<WG_O_REGS>(a.o);
    pk_wgmma_fence();
    pk_tile_pv<WG_IN_KIND, WG_D, WG_BK>(a.o, a.p, m.v(last % WG_STAGES));
    pk_wgmma_wait<0>();
    pk_pin<WG_O_REGS>(a.o);
    pk_out_rows<WG_D> r;
    pk_round_out<WG_IN_KIND, WG_D, WG_KEY_BIAS>(r, a.o, a.m_run, a.l_run, wk);
    wg_store_rows(r, area, dst);
    pk_store_drain();
}

/* The consumer warpgroups, persistent build: the work tiles in the producer's order. Between two tiles
   with keys, the next one's first S runs alongside the last P.V of the one before, whose rows are stored
   once that P.V is done. */
__device__ __forceinline__ void wg_consume_persistent(const wg_smem& m, const wg_schedule& sched,
                                                      const pk_out_dst& dst, float scale_log2)
{
    wg_acc a;
    pk_work held;   /* the work tile whose last P.V is pending */
    unsigned int w = blockIdx.x;
    for (;; w += gridDim.x) {
        if (w >= sched.n_work) return;
        held = sched.at(w);
        if (sched.has_keys(held)) break;
        pk_store_keyless<WG_IN_KIND, WG_D, WG_BQ>(held, dst);
    }
    wg_zero_o(a);
    wg_first_keys<false>(m, a, a.m_run, a.l_run, held, 0, 0, scale_log2);
    pk_pack_p<WG_IN_KIND, WG_BK>(a.p, a.s);
    wg_key_loop(m, a, held, 0, 0, scale_log2);
    pk_warp_arrive(m.q_free(0));
    unsigned int first = held.n_tiles, round = 1;
    for (w += gridDim.x; w < sched.n_work; w += gridDim.x) {
        const pk_work t = sched.at(w);
        if (!sched.has_keys(t)) {
            pk_store_keyless<WG_IN_KIND, WG_D, WG_BQ>(t, dst);
            continue;
        }
        float m_run[2], l_run[2];
        wg_first_keys<true>(m, a, m_run, l_run, t, first, round, scale_log2);
        pk_pack_p<WG_IN_KIND, WG_BK>(a.p, a.s);
        pk_out_rows<WG_D> done;
        pk_round_out<WG_IN_KIND, WG_D, WG_KEY_BIAS>(done, a.o, a.m_run, a.l_run, held);   /* with the held tile's softmax state */
        wg_store_rows(done, m.o(), dst);
        wg_zero_o(a);
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            a.m_run[r] = m_run[r];
            a.l_run[r] = l_run[r];
        }
        wg_key_loop(m, a, t, first, round, scale_log2);
        pk_warp_arrive(m.q_free(round));
        held = t;
        first += t.n_tiles;
        round++;
    }
    wg_finish(m, a, held, first - 1, m.o(), dst);
}

/* The consumer warpgroups, one block per work tile. */
__device__ __forceinline__ void wg_consume_own(const wg_smem& m, const wg_schedule& sched, const pk_out_dst& dst,
                                               float scale_log2)
{
    const pk_work t = sched.own();
    if (!sched.has_keys(t)) {
        pk_store_keyless<WG_IN_KIND, WG_D, WG_BQ>(t, dst);
        return;
    }
    wg_acc a;
    wg_zero_o(a);
    wg_first_keys<false>(m, a, a.m_run, a.l_run, t, 0, 0, scale_log2);
    pk_pack_p<WG_IN_KIND, WG_BK>(a.p, a.s);
    wg_key_loop(m, a, t, 0, 0, scale_log2);
    wg_finish(m, a, t, t.n_tiles - 1, m.q(0), dst);   /* the last S has read Q */
}

extern "C" __global__ void __launch_bounds__(WG_THREADS, 1)
joint_attention_wgmma(
    PK_MAP_OPERANDS(unsigned short),
    const __grid_constant__ pk_tensor_map tm_o,
    const __grid_constant__ pk_tensor_map tm_b,
    PK_MAP_SCALARS,
    float scale_log2, unsigned int batch)
{
    extern __shared__ __align__(1024) unsigned char wg_smem_raw[];
    const wg_smem m = wg_carve(wg_smem_raw);
    const wg_schedule sched = wg_schedule::of(seq_q, num_heads, seq_k, batch, key_lens);
    if (WG_PERSISTENT && threadIdx.x == 0) {   /* run() fences them */
        pk_bar_init(m.q_full_of(1), 1);
        pk_bar_init(m.q_free(0), wg_smem::consumer_warps());
        pk_bar_init(m.q_free(1), wg_smem::consumer_warps());
    }
    const pk_out_dst dst = {&tm_o, out, lse, sched.num_heads, seq_q, out_pitch};
#if WG_PERSISTENT
    m.run([&] { wg_produce(m, &tm_q, &tm_k, &tm_v, &tm_b, sched); },
          [&] { wg_consume_persistent(m, sched, dst, scale_log2); });
#else
    m.run([&] { wg_produce(m, &tm_q, &tm_k, &tm_v, &tm_b, sched); },
          [&] { wg_consume_own(m, sched, dst, scale_log2); });
#endif
}
