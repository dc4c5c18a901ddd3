/* key_bias.cuh: an additive bias over keys in the wgmma kernel's softmax (its WG_KEY_BIAS=1 builds), sm_90a.

   The bias is SDPA's float attn_mask when it is the same for every query row ([B, 1|H, 1, Nk]): key
   padding (0 kept, -inf or very negative dropped, as LTX-Video's text mask) or any other per-key bias.
   The host passes it as f32 [batch * num_heads][k_pad] in log2 units (the mask times log2 e; finite
   values clamped to +-FLT_MAX so that finfo.min stays finite, as SDPA keeps it; infinities kept),
   k_pad = BK ceil(seq_k / BK), read through a 2-D tensor map (k_pad columns x batch * num_heads planes,
   box BK x 1); keys >= seq_k are masked by the kernel whatever their bias.
     pk_copy_bias   the producer: key tile j's BK biases of a plane into its stage's row of shared
                    memory (rows 128-byte aligned), completing on the stage's K barrier (which the K
                    tile's copy arrives on)
     pk_add_bias    a consumer: s = s scale_log2 + bias of its key, for the thread's columns of a key
                    tile (softmax.cuh's accumulator layout), so the softmax then runs on log2 units
   Rows whose keys are all -inf (whole tiles of them, or every key) are the softmax's and epilogue's
   EMPTY_ROWS case: 0 weights, then output 0 and LSE -inf, as torch's SDPA gives. */

#ifndef PICTOR_KEY_BIAS_CUH
#define PICTOR_KEY_BIAS_CUH

#include "sm90_pipeline.cuh"

/* Key tile `column / WG_BK`'s biases of plane `plane` (a box of `bytes` f32s of the host's 2-D map, no
   swizzle) into shared memory at dst (128-byte aligned), on `bar`: its expected bytes grow by `bytes` first,
   with no arrival (the K tile's copy arrives). A tensor copy, as the K and V tiles are: the sanitizer's
   racecheck tracks its completion on the mbarrier, which it does not for a raw-address bulk copy. */
__device__ __forceinline__ void pk_copy_bias(unsigned int dst, const pk_tensor_map* map, int column, int plane,
                                             unsigned int bytes, unsigned int bar)
{
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"((unsigned long long)map), "r"(column), "r"(plane), "r"(bar) : "memory");
}

/* s = s * scale_log2 + bias[key] for NT n8 tiles of one m16 tile (columns 8n + 2t, + 1 of rows g, g + 8),
   the key tile's biases at shared address `row`. */
template <int NT>
__device__ __forceinline__ void pk_add_bias(float* s, unsigned int row, float scale_log2, unsigned int t)
{
    #pragma unroll
    for (int n = 0; n < NT; n++) {
        float b0, b1;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(b0), "=f"(b1) : "r"(row + 4 * (8 * n + 2 * t)));
        s[4 * n] = fmaf(s[4 * n], scale_log2, b0);
        s[4 * n + 1] = fmaf(s[4 * n + 1], scale_log2, b1);
        s[4 * n + 2] = fmaf(s[4 * n + 2], scale_log2, b0);
        s[4 * n + 3] = fmaf(s[4 * n + 3], scale_log2, b1);
    }
}

#endif
