/* sm90_pipeline.cuh: the Hopper (sm_90a) warp-specialised pipeline of the wgmma kernels
   (flash_attn_wgmma.cu, flash_attn_fp16x3.cu, flash_attn_fp8.cu): one producer thread streams K and V
   tiles by TMA into a STAGES-deep ring of shared-memory stages, consumer warpgroups (two; three in the
   head_dim-64 wgmma builds) read them, and mbarriers hand each stage back and forth. A kernel brings its
   shared-memory map (derived from pk_ring, which sets where the tiles lie) and the copies of its tiles.
     TMA          pk_tensor_map, pk_copy_box, pk_copy_tile: bulk tensor copies completing on an mbarrier
     mbarriers    pk_bar_init, pk_bar_expect_bytes, pk_bar_arrive, pk_bar_wait, pk_warp_arrive
     Roles        PK_THREADS, pk_consumer_regs, pk_specialise<CONSUMERS>: a producer warpgroup
                  (setmaxnreg down) and CONSUMERS consumer warpgroups (up); PK_THREADS is the two-consumer
                  kernels' block
     K/V ring     pk_smem_base; pk_ring<STAGES, CONSUMERS>: Q's and each stage's K and V full / free mbarriers,
                  run (init, then the roles), produce (the producer's loop), wait_q / wait_k / wait_v
                  and free_k / free_v (the consumers' side) */

#ifndef PICTOR_SM90_PIPELINE_CUH
#define PICTOR_SM90_PIPELINE_CUH

#include "common.cuh"

/* The roles (pk_specialise): warpgroup 0 produces, warpgroups 1 .. CONSUMERS consume, 64 query rows each.
   PK_THREADS: the block of the two-consumer kernels. The producer keeps PK_PRODUCER_REGS registers a
   thread; the consumers share the rest of the 64K register file (pk_consumer_regs). */
#define PK_THREADS 384
#define PK_PRODUCER_REGS 24

/* A consumer thread's registers (setmaxnreg, a multiple of 8) when CONSUMERS warpgroups share what the
   producer leaves: 240 for two, 160 for three. */
template <int CONSUMERS>
__host__ __device__ constexpr int pk_consumer_regs()
{
    return (65536 - 128 * PK_PRODUCER_REGS) / (128 * CONSUMERS) / 8 * 8;
}

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

/* A ROWS-row tile of 16-bit values at (row, head, batch) of `map` (box: 64 columns x ROWS rows) into dst as
   SLABS slabs of 64 columns, ROWS x 128 bytes apart, completing on `bar`, which expects all their bytes. */
template <int ROWS, int SLABS>
__device__ __forceinline__ void pk_copy_tile(unsigned int dst, const pk_tensor_map* map, int row, int head,
                                             int batch, unsigned int bar)
{
    pk_bar_expect_bytes(bar, SLABS * ROWS * 128);
    #pragma unroll
    for (int slab = 0; slab < SLABS; slab++) {
        pk_copy_box(dst + slab * ROWS * 128, map, 64 * slab, head, row, batch, bar);
    }
}

/* One arrival on `bar` for the calling warp (lane 0 arrives). */
__device__ __forceinline__ void pk_warp_arrive(unsigned int bar)
{
    if ((threadIdx.x & 31u) == 0) pk_bar_arrive(bar);
}

/* The 1024-byte aligned start of the dynamic shared memory at `raw`: TMA's 128-byte swizzle pattern
   repeats every 1024 bytes, and the wgmma descriptors assume tiles aligned to it. */
__device__ __forceinline__ unsigned int pk_smem_base(const unsigned char* raw)
{
    return (pk_smem_addr(raw) + 1023u) & ~1023u;
}

/* The warp-specialised kernels' roles: warpgroup 0 gives registers away (setmaxnreg to PK_PRODUCER_REGS)
   and its thread 0 runs `produce` (the TMA copies); the CONSUMERS consumer warpgroups take them
   (pk_consumer_regs) and run `consume`. */
template <int CONSUMERS, typename Produce, typename Consume>
__device__ __forceinline__ void pk_specialise(Produce produce, Consume consume)
{
    static_assert(CONSUMERS >= 2 && pk_consumer_regs<CONSUMERS>() >= PK_PRODUCER_REGS,
                  "two or more consumer warpgroups, each left at least the producer's registers");
    if (threadIdx.x < 128) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PK_PRODUCER_REGS) : "memory");
        if (threadIdx.x == 0) produce();
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(pk_consumer_regs<CONSUMERS>()) : "memory");
        consume();
    }
}

/* The warp-specialised kernels' mbarriers at `bars`, 8 bytes each: q_full, then k_full[STAGES],
   v_full[STAGES] (one arrival each: the producer's expect-bytes), k_free[STAGES], v_free[STAGES] (one
   arrival per warp of the CONSUMERS consumer warpgroups). Each kernel's shared-memory layout derives from
   it and sets `bars`;
   init: thread 0 initialises them, then the whole block synchronises.
   Key tile j lives in stage j % STAGES, in that stage's round j / STAGES: its full barriers complete
   phase j / STAGES, and the producer reuses the stage once the consumers freed round j / STAGES - 1. */
template <int STAGES, int CONSUMERS = 2>
struct pk_ring {
    unsigned int bars;
    /* The arrivals that free a stage: one per consumer warp (a function, not a static member, which NVRTC
       would emit as a global). */
    __device__ static constexpr unsigned int consumer_warps() { return 4 * CONSUMERS; }
    __device__ unsigned int q_full() const { return bars; }
    __device__ unsigned int k_full(unsigned int s) const { return bars + 8 * (1 + s); }
    __device__ unsigned int v_full(unsigned int s) const { return bars + 8 * (1 + STAGES + s); }
    __device__ unsigned int k_free(unsigned int s) const { return bars + 8 * (1 + 2 * STAGES + s); }
    __device__ unsigned int v_free(unsigned int s) const { return bars + 8 * (1 + 3 * STAGES + s); }

    __device__ void init() const
    {
        if (threadIdx.x == 0) {
            pk_bar_init(q_full(), 1);
            #pragma unroll
            for (int s = 0; s < STAGES; s++) {
                pk_bar_init(k_full(s), 1);
                pk_bar_init(v_full(s), 1);
                pk_bar_init(k_free(s), consumer_warps());
                pk_bar_init(v_free(s), consumer_warps());
            }
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        __syncthreads();
    }

    /* The kernel after its shared-memory map: the mbarriers initialised, then the roles (pk_specialise). */
    template <typename Produce, typename Consume>
    __device__ __forceinline__ void run(Produce produce, Consume consume) const
    {
        init();
        pk_specialise<CONSUMERS>(produce, consume);
    }

    /* The producer (one thread): for each key tile j, once its stage is free, copy_k(j, s) issues the
       copies of K completing on k_full(s), then copy_v(j, s) V's on v_full(s). A persistent kernel keeps
       one ring over its work tiles: `first` counts the key tiles it streamed before this work tile, and
       tile j sits where the ring's tile first + j would. */
    template <typename CopyK, typename CopyV>
    __device__ __forceinline__ void produce(unsigned int n_tiles, CopyK copy_k, CopyV copy_v,
                                            unsigned int first = 0) const
    {
        for (unsigned int j = 0; j < n_tiles; j++) {
            const unsigned int c = first + j, s = c % STAGES, parity = (c / STAGES - 1) & 1;
            if (c >= STAGES) pk_bar_wait(k_free(s), parity);
            copy_k(j, s);
            if (c >= STAGES) pk_bar_wait(v_free(s), parity);
            copy_v(j, s);
        }
    }

    /* The consumers: wait for the Q tile (of work tile `round`, persistent kernels), or for K or V of the
       ring's key tile j in its stage s = j % STAGES, to land; free stage s's K or V (one arrival per warp)
       once read. Callers pass s, which they also address the stage's tiles with. */
    __device__ __forceinline__ void wait_q(unsigned int round = 0) const { pk_bar_wait(q_full(), round & 1); }
    __device__ __forceinline__ void wait_k(unsigned int s, unsigned int j) const
    {
        pk_bar_wait(k_full(s), (j / STAGES) & 1);
    }
    __device__ __forceinline__ void wait_v(unsigned int s, unsigned int j) const
    {
        pk_bar_wait(v_full(s), (j / STAGES) & 1);
    }
    __device__ __forceinline__ void free_k(unsigned int s) const { pk_warp_arrive(k_free(s)); }
    __device__ __forceinline__ void free_v(unsigned int s) const { pk_warp_arrive(v_free(s)); }
};

#endif
