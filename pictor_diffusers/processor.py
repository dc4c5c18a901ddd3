"""`PictorAttn`: one diffusers attention processor for every FLUX.2 and FLUX.1 attention.

    transformer.set_attn_processor(PictorAttn())

serves both module types of `Flux2Transformer2DModel`:

* `Flux2Attention` (double-stream blocks): separate or fused
  (`fuse_qkv_projections()`) Q/K/V projections for image and text tokens;
* `Flux2ParallelSelfAttention` (single-stream blocks): QKV fused with the MLP
  input projection, attention and MLP outputs projected together;

and `FluxAttention`, every attention of FLUX.1's `FluxTransformer2DModel`
(double-stream, and attention-only `pre_only` single-stream blocks; see
`pictor_diffusers.flux1`, which matches stock `FluxAttnProcessor`).

The math is that of diffusers' stock `Flux2AttnProcessor` /
`Flux2ParallelSelfAttnProcessor`: projections, QK RMSNorm, [text, image] token
order, RoPE, attention, cast back to the model dtype, output projections. On
CUDA the part after the projections is two launches, the fused prologue and
the attention kernel, which writes its output in the model dtype; on CPU the
same algorithms run in torch. `precision` picks the contract:

* "fp32" (default, parity): norms, RoPE and attention in float32 whatever the
  model dtype; attention matches float64 to about 1e-6.
* "bf16" / "fp16" (speed): norms and RoPE in float32, q/k/v rounded once to the
  16-bit dtype, attention on 16-bit tensor cores with f32 accumulation and f32
  softmax (wgmma on Hopper); as accurate as SDPA's 16-bit kernels.
* "fp8" (8-bit speed, lossy): norms and RoPE in float32, q/k/v rounded to
  bf16, then quantised on the GPU (int8 q and smoothed k with per-block
  scales, E4M3 v per channel) for int8 Q.K and FP8 P.V on Hopper; see the
  README's precision contract for its measured error.
* "auto": the 16-bit path in the model's dtype for bf16/fp16 models, "fp32"
  for fp32 models.

q and k are bounded by the RMSNorm, v is not: "fp16" on a bf16 or fp32 model
turns values beyond fp16's 65504 into inf. "auto" never narrows the range.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

from .flux1 import flux1_attention
from .kv_cache import KvRequest, kv_attention, kv_gap, kv_request
from .ops import attention
from .parallel import check_local_rope, context_parallel, context_parallel_attention
from .projections import joint_segments
from .prologue import Rope, Segment, pack_head_major
from .registry import eight_bit_kernels, kernels_for
from .validation import OUT_DTYPE_CHOICES

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "auto": None}
_DOUBLE_STREAM_ARGS = ("encoder_hidden_states", "attention_mask", "image_rotary_emb")
_SINGLE_STREAM_ARGS = ("attention_mask", "image_rotary_emb")


def _bind(args: tuple[Any, ...], names: tuple[str, ...], given: dict[str, Any]) -> dict[str, Any]:
    """Merge positional `args` (in `names` order) with keyword arguments."""
    if len(args) > len(names):
        raise TypeError(f"PictorAttn got {len(args)} positional arguments after hidden_states; expected {names}")
    bound = dict(zip(names, args, strict=False))
    for name in names[len(args) :]:
        bound[name] = given.get(name)
    return bound


def _reject_mask(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None:
        raise ValueError(
            "PictorAttn computes unmasked attention, as FLUX.2 uses it; got an attention_mask "
            f"of shape {tuple(attention_mask.shape)}"
        )


def _check_precision(precision: str, kernel: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    allowed = {"fp32": kernels_for("float32"), "auto": ("auto",), "fp8": ("auto", *eight_bit_kernels())}.get(
        precision, kernels_for("bfloat16", lossy=False)
    )
    if kernel not in allowed:
        raise ValueError(f"kernel={kernel!r} does not serve precision={precision!r}; choose one of {allowed}")


class PictorAttn:
    """Attention processor for FLUX.2 on pictor's attention kernels.

    Args:
        kernel: for precision "fp32": "auto" (fp16x3 wgmma on Hopper at
            head_dim 128, 3xTF32 tensor cores where the GPU and head_dim allow,
            the scalar-FP32 kernel otherwise), "fp16x3", "tf32x3" or "f32"
            (the reference). For "bf16"/"fp16": "auto"
            (wgmma on Hopper, mma.sync elsewhere), "wgmma" or "mma16". For
            "fp8": "auto" or "fp8" (the same kernel). For "auto": "auto" only.
        precision: "fp32" (parity, default), "bf16", "fp16", "fp8" or "auto"
            (the model's 16-bit dtype where it has one); see the module docstring.

    Serves `Flux2Attention`, `Flux2ParallelSelfAttention` and FLUX.1's
    `FluxAttention`, and FLUX.2-klein's reference-image KV cache
    (`kv_cache_mode` "extract" / "cached", `pictor_diffusers.kv_cache`);
    anything else, an attention mask, or an unknown keyword raises an error
    that names it. Under diffusers' context parallelism
    (`enable_parallelism`: Ulysses, ring, or unified ring x Ulysses) it attends
    over the whole sequence through `pictor_diffusers.parallel`; the KV-cache
    modes under context parallelism raise NotImplementedError. CUDA tensors need CuPy (the
    `cuda12` / `cuda13` extras); CPU tensors run the pure-torch twins of the
    kernels. Inference only: the kernels have no backward.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, kernel: str = "auto", precision: str = "fp32") -> None:
        _check_precision(precision, kernel)
        self.kernel = eight_bit_kernels()[0] if precision == "fp8" else kernel
        self.precision = precision

    def _compute_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype q, k, v are packed in: float32, or the 16-bit dtype of the fast path."""
        chosen = PRECISIONS[self.precision]
        if chosen is not None:
            return chosen
        return model_dtype if model_dtype in (torch.bfloat16, torch.float16) else torch.float32

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        *args: Any,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rope | None = None,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_ref_tokens: int = 0,
        num_txt_tokens: int = 0,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if kwargs:
            raise TypeError(f"PictorAttn does not understand the attention kwargs {sorted(kwargs)}")
        parallel = context_parallel(self._parallel_config)  # an unset config fails here, before any collective
        if kv_cache_mode is not None and parallel is not None:
            raise NotImplementedError(
                f"PictorAttn does not serve kv_cache_mode={kv_cache_mode!r} under context parallelism"
            )
        given = {
            "encoder_hidden_states": encoder_hidden_states,
            "attention_mask": attention_mask,
            "image_rotary_emb": image_rotary_emb,
        }
        if isinstance(attn, Flux2ParallelSelfAttention):
            if encoder_hidden_states is not None:
                raise TypeError("Flux2ParallelSelfAttention takes no encoder_hidden_states")
            kv = kv_request(kv_cache_mode, kv_cache, num_txt_tokens, num_ref_tokens)
            return self._single_stream(attn, hidden_states, kv, **_bind(args, _SINGLE_STREAM_ARGS, given))
        if isinstance(attn, Flux2Attention):
            bound = _bind(args, _DOUBLE_STREAM_ARGS, given)
            text = bound["encoder_hidden_states"]
            kv = kv_request(kv_cache_mode, kv_cache, 0 if text is None else text.shape[1], num_ref_tokens)
            return self._double_stream(attn, hidden_states, kv, **bound)
        if kv_cache_mode is not None:
            raise TypeError(f"kv_cache_mode is a FLUX.2 mode; {type(attn).__name__} does not take it")
        if isinstance(attn, FluxAttention):
            return flux1_attention(self._attend, attn, hidden_states, **_bind(args, _DOUBLE_STREAM_ARGS, given))
        raise TypeError(
            f"PictorAttn serves Flux2Attention, Flux2ParallelSelfAttention and FluxAttention, not {type(attn).__name__}"
        )

    def _attend(
        self, segments: list[Segment], head_dim: int, rope: Rope | None, kv: KvRequest | None = None
    ) -> torch.Tensor:
        """Prologue + attention: token-major `[B, N, H*D]` in the projections' dtype.

        Under context parallelism (`parallel.py`: Ulysses, ring, unified) the prologue runs on this rank's
        tokens, the attention over the whole sequence, and N is this rank's token count; ring partials are
        written in the compute dtype (float32 on the parity path) and merged in float32. `kv`: a KV-cache mode
        (`kv_cache.py`).
        """
        dtype = segments[-1].query.dtype
        compute = self._compute_dtype(dtype)
        groups = context_parallel(self._parallel_config)
        if groups is not None:
            check_local_rope(rope, sum(segment.query.shape[1] for segment in segments))
        query, key, value = pack_head_major(segments, head_dim, rope, compute, kv_gap(kv))
        out_dtype = dtype if compute == torch.float32 and dtype in OUT_DTYPE_CHOICES else compute
        if kv is not None:
            return kv_attention(kv, query, key, value, out_dtype, self.kernel).to(dtype)
        if groups is None:
            return attention(query, key, value, out_dtype=out_dtype, kernel=self.kernel).to(dtype)
        run = partial(attention, out_dtype=out_dtype, kernel=self.kernel)
        run_lse = partial(attention, out_dtype=compute, kernel=self.kernel, return_lse=True)
        return context_parallel_attention(query, key, value, groups, run, run_lse).to(dtype)

    def _double_stream(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        kv: KvRequest | None,
        encoder_hidden_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: Rope | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        _reject_mask(attention_mask)
        segments = joint_segments(attn, hidden_states, encoder_hidden_states)

        hidden_states = self._attend(segments, attn.head_dim, image_rotary_emb, kv)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [text_len, hidden_states.shape[1] - text_len], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states

    def _single_stream(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        kv: KvRequest | None,
        attention_mask: torch.Tensor | None,
        image_rotary_emb: Rope | None,
    ) -> torch.Tensor:
        _reject_mask(attention_mask)
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_width = 3 * attn.inner_dim
        mlp_width = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_width // (qkv_width + mlp_width)
        qkv, mlp_hidden_states = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        segment = Segment(*qkv.chunk(3, dim=-1), attn.norm_q, attn.norm_k)

        attn_output = self._attend([segment], attn.head_dim, image_rotary_emb, kv)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([attn_output, mlp_hidden_states], dim=-1))
