"""`PictorAttn`: one diffusers attention processor for every FLUX.2, FLUX.1, SD3 / SD3.5 and CogVideoX attention.

    transformer.set_attn_processor(PictorAttn())

The module types it serves are those with an adapter (`pictor_diffusers.integration.adapters`): FLUX.2's
`Flux2Attention` (double-stream) and `Flux2ParallelSelfAttention` (single-stream), FLUX.1's
`FluxAttention`, and diffusers' generic `Attention` as SD3 / SD3.5 and CogVideoX build it. The adapter
binds the call and runs the module's projections and output projections around `PictorAttn._attend`,
with the math of diffusers' stock processors: projections, QK norm (RMSNorm; for SD3 and CogVideoX also
none or LayerNorm), [text, image] token order, RoPE, attention, cast back to the model dtype, output
projections. On CUDA
the part after the projections is two launches, the fused prologue and the attention kernel, which
writes its output in the model dtype (on the parity path's fp16x3 kernel, the prologue writes the
kernel's split planes directly: `pictor_diffusers.ops.split_route`); on CPU the same algorithms run in
torch. `precision` picks the
contract ("fp32" parity, "bf16" / "fp16" speed, "fp8" 8-bit speed, "auto"): see
`pictor_diffusers.integration.precision`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from ..ops.attention import attention
from ..ops.prologue import Rope, Segment, pack_head_major
from ..ops.split_route import split_attention, takes_split_route
from ..ops.validation import OUT_DTYPE_CHOICES
from .adapters import KvArgs, adapter_for
from .kv_cache import KvRequest, kv_attention, kv_gap
from .parallel import check_local_rope, context_parallel, context_parallel_attention
from .precision import compute_dtype, resolve_kernel


class PictorAttn:
    """Attention processor for FLUX.2, FLUX.1, SD3 and CogVideoX on pictor's attention kernels.

    Args:
        kernel: for precision "fp32": "auto" (fp16x3 wgmma on Hopper at
            head_dim 128, 3xTF32 tensor cores where the GPU and head_dim allow,
            the scalar-FP32 kernel otherwise), "fp16x3", "tf32x3" or "f32"
            (the reference). For "bf16"/"fp16": "auto"
            (wgmma on Hopper, mma.sync elsewhere), "wgmma" or "mma16". For
            "fp8": "auto" or "int8" (u8 x int8 P.V), or "fp8" (E4M3 P.V: 2.5x the error, a few percent
            faster; see the README's precision contract). For "auto": "auto" only.
        precision: "fp32" (parity, default), "bf16", "fp16", "fp8" or "auto"
            (the model's 16-bit dtype where it has one); see `pictor_diffusers.integration.precision`.

    Serves `Flux2Attention`, `Flux2ParallelSelfAttention`, FLUX.1's `FluxAttention`, the
    `Attention` modules of SD3 / SD3.5 and CogVideoX (and any type with an adapter,
    `pictor_diffusers.integration.adapters`), and FLUX.2-klein's
    reference-image KV cache (`kv_cache_mode` "extract" / "cached", `pictor_diffusers.integration.kv_cache`);
    anything else, an attention mask, or an unknown keyword raises an error
    that names it. Under diffusers' context parallelism
    (`enable_parallelism`: Ulysses, ring, or unified ring x Ulysses) it attends
    over the whole sequence through `pictor_diffusers.integration.parallel`; the KV-cache
    modes under context parallelism raise NotImplementedError. CUDA tensors need CuPy (the
    `cuda12` / `cuda13` extras); CPU tensors run the pure-torch twins of the
    kernels. Inference only: the kernels have no backward.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, kernel: str = "auto", precision: str = "fp32") -> None:
        self.kernel = resolve_kernel(precision, kernel)
        self.precision = precision

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
        """`attn`'s attention on `hidden_states` `[B, N, C]`; returns what its stock processor returns.

        The arguments after hidden_states come in the order of `attn`'s adapter (`Adapter.args`).
        diffusers passes only the keywords this signature names.
        """
        if kwargs:
            raise TypeError(f"PictorAttn does not understand the attention kwargs {sorted(kwargs)}")
        parallel = context_parallel(self._parallel_config)  # an unset config fails here, before any collective
        if kv_cache_mode is not None and parallel is not None:
            raise NotImplementedError(
                f"PictorAttn does not serve kv_cache_mode={kv_cache_mode!r} under context parallelism"
            )
        adapter = adapter_for(attn)
        given = {
            "encoder_hidden_states": encoder_hidden_states,
            "attention_mask": attention_mask,
            "image_rotary_emb": image_rotary_emb,
        }
        kv_args = KvArgs(kv_cache, kv_cache_mode, num_ref_tokens, num_txt_tokens)
        return adapter.forward(attn, adapter.bind(attn, hidden_states, args, given, kv_args), self._attend)

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
        compute = compute_dtype(self.precision, dtype)
        groups = context_parallel(self._parallel_config)
        out_dtype = dtype if compute == torch.float32 and dtype in OUT_DTYPE_CHOICES else compute
        # The KV cache (a gap in k and v, row windows) and context parallelism need q, k, v themselves: they
        # keep the unfused route, as does every call the split-planes kernel would not run.
        plain = kv is None and groups is None and compute == torch.float32
        if plain and takes_split_route(segments, head_dim, self.kernel, out_dtype):
            return split_attention(segments, head_dim, rope, self.kernel, out_dtype).to(dtype)
        if groups is not None:
            check_local_rope(rope, sum(segment.query.shape[1] for segment in segments))
        query, key, value = pack_head_major(segments, head_dim, rope, compute, kv_gap(kv))
        if kv is not None:
            return kv_attention(kv, query, key, value, out_dtype, self.kernel).to(dtype)
        if groups is None:
            return attention(query, key, value, out_dtype=out_dtype, kernel=self.kernel).to(dtype)
        run = partial(attention, out_dtype=out_dtype, kernel=self.kernel)
        run_lse = partial(attention, out_dtype=compute, kernel=self.kernel, return_lse=True)
        return context_parallel_attention(query, key, value, groups, run, run_lse).to(dtype)
