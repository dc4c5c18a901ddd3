"""Input checks for the attention entry point; every error names the actual value."""

from __future__ import annotations

import math

import torch

from .kernel_sources import MAX_HEAD_DIM

_MAX_GRID_YZ = 65535


def check_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise ValueError/TypeError unless q, k, v are valid head-major inputs.

    Valid means: three tensors on one CPU or CUDA device, float32, rank 4
    `[B, H, N, D]` with identical shapes, contiguous, B, H, N >= 1,
    1 <= D <= 384, and B, H <= 65535 (the kernel's grid limits).
    """
    tensors = {"query": query, "key": key, "value": value}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in tensors.items():
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on device {tensor.device}; pictor-diffusers supports cpu and cuda")
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device} but query is on {query.device}; all must share a device")
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"{name} has dtype {tensor.dtype}; the parity kernel takes torch.float32 (upcast with .float())"
            )
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be head-major [B, H, N, D], got shape {tuple(tensor.shape)}")
        if tensor.shape != query.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but query has {tuple(query.shape)}; they must match"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous [B, H, N, D], got strides {tuple(tensor.stride())} "
                f"for shape {tuple(tensor.shape)}"
            )
    _check_extents(*query.shape)


def _check_extents(batch: int, heads: int, seq: int, head_dim: int) -> None:
    if min(batch, heads, seq) < 1:
        raise ValueError(f"batch, heads and seq must be >= 1, got B={batch}, H={heads}, N={seq}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if batch > _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
        raise ValueError(f"batch and heads must be <= {_MAX_GRID_YZ}, got B={batch}, H={heads}")


KERNEL_CHOICES = ("auto", "tf32x3", "f32")
OUT_DTYPE_CHOICES = (torch.float32, torch.bfloat16, torch.float16)


def check_kernel_choice(kernel: str, out_dtype: torch.dtype) -> None:
    """Raise ValueError unless `kernel` and `out_dtype` are supported choices."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if out_dtype not in OUT_DTYPE_CHOICES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPE_CHOICES}, got {out_dtype}")


def check_scale(scale: float) -> None:
    """Raise ValueError unless the logit scale is a finite positive number."""
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
