"""The 8-bit path from FLUX projections: prologue and quantisation fused, then the 8-bit kernel.

`attention_8bit` serves `PictorAttn(precision="fp8")` outside the KV-cache and context-parallel modes. On
CUDA, for projections whose rows are 16-byte aligned and head_dim 128, it is three launches: the fused
prologue + prepass (`quantized.quantize_projections`, two phases, reading the projections where they lie)
and the 8-bit kernel; the 16-bit q, k and v are never written. Its codes, and so its output, equal those
of the prologue (bfloat16) followed by `ops.attention(kernel="fp8")`, which is what runs for every other
layout and on the CPU (there with the kernel's twin). Under `torch.compile` it is one custom op,
`pictor::attention_8bit`, with a fake implementation (no graph break).
"""

from __future__ import annotations

import torch

from .launch import attention_from_projections_cuda
from .ops import attention, needs_op
from .prologue import Rope, Segment, prologue_impl, prologue_inputs
from .quantized import projections_blocker
from .registry import eight_bit_kernels
from .validation import prologue_layout


def attention_8bit(segments: list[Segment], head_dim: int, rope: Rope | None, kernel: str) -> torch.Tensor:
    """QK norm, join, RoPE and 8-bit attention of one or two segments (see `prologue.pack_head_major`):
    token-major `[B, N, H*D]` bfloat16, scale D^-0.5; `kernel` an 8-bit registry name."""
    projections, weights, rope_list, eps = prologue_inputs(segments, head_dim, rope)
    if needs_op(*projections):
        return torch.ops.pictor.attention_8bit(projections, weights, rope_list, eps, kernel)
    return _attention_8bit_impl(projections, weights, rope_list, eps, kernel)


def fused_blocker(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> str | None:
    """Why these prologue arguments take the unfused route (None: the fused launches serve them)."""
    layout = prologue_layout(projections, weights, rope, eps)
    if layout is None or layout.device_index < 0:
        return "the fused prologue takes CUDA projections in the prologue kernel's layouts only"
    return projections_blocker(layout)


def _attention_8bit_impl(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float],
    kernel: str,
) -> torch.Tensor:  # fmt: skip
    if kernel not in eight_bit_kernels():
        raise ValueError(f"attention_8bit takes an 8-bit kernel {eight_bit_kernels()}, got kernel={kernel!r}")
    layout = prologue_layout(projections, weights, rope, eps)
    if layout is not None and layout.device_index >= 0 and projections_blocker(layout) is None:
        return attention_from_projections_cuda(layout, kernel)
    query, key, value = prologue_impl(projections, weights, rope, eps, torch.bfloat16)
    return attention(query, key, value, out_dtype=torch.bfloat16, kernel=kernel)


@torch.library.custom_op("pictor::attention_8bit", mutates_args=())
def _attention_8bit_op(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float],
    kernel: str,
) -> torch.Tensor:  # fmt: skip
    return _attention_8bit_impl(projections, weights, rope, eps, kernel)


@_attention_8bit_op.register_fake
def _attention_8bit_op_fake(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float],
    kernel: str,
) -> torch.Tensor:  # fmt: skip
    image = projections[-1]
    seq = sum(p.shape[1] for p in projections[::3])
    return image.new_empty((image.shape[0], seq, image.shape[-1]), dtype=torch.bfloat16)


def _no_backward(ctx: object, *grads: torch.Tensor) -> None:
    raise NotImplementedError("pictor-diffusers kernels are inference-only: 8-bit attention has no backward")


_attention_8bit_op.register_autograd(_no_backward)
