"""The public attention entry point, registered as a torch custom op.

`torch.ops.pictor.attention_f32` is opaque to `torch.compile` (it has a fake
implementation for tracing), so compiled FLUX.2 graphs keep it as one node with
no graph break; its CUDA implementation is capturable in CUDA graphs.
"""

from __future__ import annotations

import torch

from .reference import online_softmax_attention
from .validation import check_attention_inputs


@torch.library.custom_op("pictor::attention_f32", mutates_args=())
def _attention_f32(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    if query.device.type == "cuda":
        from .cuda_launch import flash_attention_f32_cuda

        return flash_attention_f32_cuda(query, key, value, scale)
    return online_softmax_attention(query, key, value, scale)


@_attention_f32.register_fake
def _attention_f32_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    batch, heads, seq, head_dim = query.shape
    return query.new_empty((batch, seq, heads * head_dim))


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Non-causal scaled-dot-product attention, f32 throughout (inference only).

    Args:
        query, key, value: head-major `[B, H, N, D]`, contiguous torch.float32,
            all on one device. 1 <= D <= 384; any N >= 1.
        scale: logit scale; defaults to `D ** -0.5`.

    Returns:
        token-major `[B, N, H*D]` torch.float32 on the inputs' device:
        `out[b, n, h*D + d] = softmax(scale * q k^T)[b, h, n, :] @ v[b, h, :, d]`.

    On CUDA it launches the NVRTC-compiled `joint_attention_flash_f32` kernel on
    torch's current stream; on CPU it runs the same online-softmax algorithm in
    pure torch (`pictor_diffusers.reference`).
    """
    check_attention_inputs(query, key, value)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    return torch.ops.pictor.attention_f32(query, key, value, float(scale))
