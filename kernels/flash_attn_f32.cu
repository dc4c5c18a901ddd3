/* flash_attn_f32.cu: parity-first joint attention for FLUX.2 (pictor-diffusers).

   Algorithm: flash-attention v2 forward with an online (running-max) softmax,
   non-causal, no mask:
       S = scale * Q K^T,  P = softmax(S) row-wise,  O = P V.
   Every value (Q, K, V, S, P, the running max m, the running sum l and the
   output accumulator O) is f32, accumulated in f32 by scalar FFMA. There are no
   tensor cores and no 16-bit staging: this kernel is the accuracy reference of
   the package (max-abs about 1e-6..1e-5 against float64 on N(0,1) inputs).

   Launch geometry (FA_BQ, FA_BK, FA_THREADS and FA_DMAX come from the host
   as -D, unsigned, e.g. -DFA_BQ=8u; the kernel checks them against its own
   design below):
       grid  = (ceil(seq_q / FA_BQ), num_heads, batch)
       block = (FA_THREADS = 128, 1, 1)   -> FA_WARPS = 4 warps
       dynamic shared memory = 2 * FA_BK * head_dim * sizeof(float) bytes
         (Ksh | Vsh); with FA_BK = 32, head_dim 128 -> 32 KiB, 256 -> 64 KiB,
         384 -> 96 KiB. Above 48 KiB the host raises the kernel's dynamic
         shared-memory limit.
   Each block owns FA_BQ = 8 query rows of one (batch, head): each warp owns
   FA_RPW = 2 rows, and within a warp lane t holds head dims {t, t+32, ...} of
   its rows' Q and O in registers. A score is a lane-partial dot product
   finished by a butterfly shuffle reduction, so every lane sees every score.
   Keys stream through shared memory in tiles of FA_BK (32) keys; any
   FA_BK >= 1 is correct.

   Layout (a window of rows: the host offsets each pointer to the window's
   first row; pitches are the full tensors' row counts):
       q       : head-major  [batch, num_heads, q_pitch, head_dim] f32, rows
                 [0, seq_q) computed
       k, v    : head-major  [batch, num_heads, kv_pitch, head_dim] f32, keys
                 [0, seq_k) attended
       out     : token-major [batch, out_pitch, num_heads * head_dim] f32
                 out[b, n, h*head_dim + d] = O[b, h, n, d]
       lse     : [batch, out_pitch, num_heads] f32, natural log-sum-exp of
                 each row's scaled logits; null: not written
       key_lens: [batch] i32 or null, read by the FA_KEY_LENS=1 build only:
                 batch b attends its first key_lens[b] keys (attention_io.cuh)

   Variants: the host compiles this source once per FA_DMAX (the compile-time
   bound on head_dim that sizes the per-lane register arrays); any head_dim in
   [1, FA_DMAX] is exact, since only dims below head_dim are touched.
   Precision: f32 throughout, scalar FFMA products, expf / logf from the math
   library, subnormals flushed (-ftz=true from the host); the output is f32. */

#include "attention_io.cuh"
#include "common.cuh"

#if !defined(FA_DMAX) || !defined(FA_BQ) || !defined(FA_BK) || !defined(FA_THREADS)
#error "flash_attn_f32.cu needs -D FA_DMAX, FA_BQ, FA_BK and FA_THREADS from the host"
#endif
#if !defined(FA_KEY_LENS)
#error "flash_attn_f32.cu needs -D FA_KEY_LENS=0 or 1 from the host"
#endif

#define FA_WARPS 4u
#define FA_RPW 2u                    /* query rows per warp */
#define FA_MAXDPL ((FA_DMAX + 31u) / 32u)  /* head dims held per lane */
static_assert(FA_THREADS == FA_WARPS * 32u, "FA_THREADS must be 128u: the kernel runs 4 warps");
static_assert(FA_BQ == FA_WARPS * FA_RPW, "FA_BQ must be 8u: 4 warps of 2 query rows");
static_assert(FA_BK >= 1u && FA_DMAX >= 1u, "FA_BK and FA_DMAX must be positive");

/* Running-max start value. The first key of a row always replaces it
   (any finite score exceeds -FLT_MAX), and the explicit test below forces
   the first correction factor to exactly 0. */
#define FA_NEG_INF (-3.40282347e+38f)

extern "C" __global__ void joint_attention_flash_f32(
    PK_POINTER_OPERANDS(float, float),
    PK_POINTER_SCALARS,
    unsigned int head_dim,
    float scale)
{
    const unsigned int h = blockIdx.y;
    const unsigned int b = blockIdx.z;
    const unsigned int q0 = blockIdx.x * FA_BQ;
    if (h >= num_heads || q0 >= seq_q) return;
#if FA_KEY_LENS
    if (pk_no_keys<0>(key_lens, seq_k, out, lse, FA_BQ, seq_q, num_heads, head_dim, out_pitch)) return;
#endif

    const unsigned int tid = threadIdx.x;
    const unsigned int lane = tid & 31u;
    const unsigned int wid = tid >> 5u;

    /* Offsets of this (batch, head) slice in the head-major inputs. */
    const unsigned long long plane = (unsigned long long)b * num_heads + h;
    const unsigned long long q_off = plane * q_pitch * head_dim;
    const unsigned long long kv_off = plane * kv_pitch * head_dim;

    extern __shared__ float fa_smem[];
    float* Ksh = fa_smem;
    float* Vsh = fa_smem + FA_BK * head_dim;

    /* Row ownership is warp-uniform, so every lane of a warp runs the same
       barriers and shuffles; only loads and the final store are guarded. */
    unsigned int qrow[FA_RPW];
    bool owns[FA_RPW];
    float Q[FA_RPW][FA_MAXDPL];
    float O[FA_RPW][FA_MAXDPL];
    float m[FA_RPW];
    float l[FA_RPW];
    #pragma unroll
    for (unsigned int rr = 0u; rr < FA_RPW; rr++) {
        const unsigned int row = wid + rr * FA_WARPS;
        qrow[rr] = q0 + row;
        owns[rr] = qrow[rr] < seq_q;
        m[rr] = FA_NEG_INF;
        l[rr] = 0.0f;
        const float* qsrc = q + q_off + (unsigned long long)qrow[rr] * head_dim;
        #pragma unroll
        for (unsigned int s = 0u; s < FA_MAXDPL; s++) {
            const unsigned int d = lane + s * 32u;
            Q[rr][s] = (owns[rr] && d < head_dim) ? qsrc[d] : 0.0f;
            O[rr][s] = 0.0f;
        }
    }

    const unsigned int k_tiles = (seq_k + FA_BK - 1u) / FA_BK;
    for (unsigned int kt = 0u; kt < k_tiles; kt++) {
        const unsigned int k0 = kt * FA_BK;
        const unsigned int k_valid = min(FA_BK, seq_k - k0);

        /* Stage the key/value tile; rows past the sequence end are zeroed
           and never read by the score loop below. */
        for (unsigned int i = tid; i < FA_BK * head_dim; i += FA_THREADS) {
            const unsigned int kk = i / head_dim;
            float kv = 0.0f;
            float vv = 0.0f;
            if (kk < k_valid) {
                const unsigned long long src = kv_off + (unsigned long long)k0 * head_dim + i;
                kv = k[src];
                vv = v[src];
            }
            Ksh[i] = kv;
            Vsh[i] = vv;
        }
        __syncthreads();

        for (unsigned int kk = 0u; kk < k_valid; kk++) {
            const float* ksp = Ksh + kk * head_dim;
            const float* vsp = Vsh + kk * head_dim;
            #pragma unroll
            for (unsigned int rr = 0u; rr < FA_RPW; rr++) {
                float partial = 0.0f;
                #pragma unroll
                for (unsigned int s = 0u; s < FA_MAXDPL; s++) {
                    const unsigned int d = lane + s * 32u;
                    if (d < head_dim) partial += Q[rr][s] * ksp[d];
                }
                const float sc = pk_warp_sum(partial) * scale;

                const float m_new = fmaxf(m[rr], sc);
                const float corr = (m[rr] == FA_NEG_INF) ? 0.0f : expf(m[rr] - m_new);
                const float p = expf(sc - m_new);
                l[rr] = l[rr] * corr + p;
                #pragma unroll
                for (unsigned int s = 0u; s < FA_MAXDPL; s++) {
                    const unsigned int d = lane + s * 32u;
                    if (d < head_dim) O[rr][s] = O[rr][s] * corr + p * vsp[d];
                }
                m[rr] = m_new;
            }
        }
        __syncthreads();
    }

    /* out[b, n, h*head_dim + d] = O[d] / l. Every row has at least one key,
       so l >= 1 here (the maximum's own term contributes exp(0) = 1). */
    const unsigned long long inner = (unsigned long long)num_heads * head_dim;
    #pragma unroll
    for (unsigned int rr = 0u; rr < FA_RPW; rr++) {
        if (!owns[rr]) continue;
        const float inv = 1.0f / l[rr];
        const unsigned long long token = (unsigned long long)b * out_pitch + qrow[rr];
        float* dst = out + token * inner + (unsigned long long)h * head_dim;
        if (lse != nullptr && lane == 0u) lse[token * num_heads + h] = m[rr] + logf(l[rr]);
        #pragma unroll
        for (unsigned int s = 0u; s < FA_MAXDPL; s++) {
            const unsigned int d = lane + s * 32u;
            if (d < head_dim) dst[d] = O[rr][s] * inv;
        }
    }
}
