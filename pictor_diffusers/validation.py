"""Input checks for the attention entry point; every error names the actual value."""

from __future__ import annotations

import math

import torch

from .kernel_sources import MAX_HEAD_DIM

_MAX_GRID_YZ = 65535


def check_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise ValueError/TypeError unless q, k, v are valid head-major inputs.

    Valid means: three tensors on one CPU or CUDA device, one dtype out of
    float32 / bfloat16 / float16, rank 4 `[B, H, N, D]` with identical shapes,
    contiguous, B, H, N >= 1, 1 <= D <= 384, and B, H <= 65535 (the kernels'
    grid limits).
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
        if tensor.dtype not in OUT_DTYPE_CHOICES:
            raise TypeError(f"{name} has dtype {tensor.dtype}; pictor attention takes float32, bfloat16 or float16")
        if tensor.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}; they must match")
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


OUT_DTYPE_CHOICES = (torch.float32, torch.bfloat16, torch.float16)
F32_KERNELS = ("auto", "tf32x3", "f32")
HALF_KERNELS = ("auto", "wgmma", "mma16")
KERNEL_CHOICES = ("auto", "tf32x3", "f32", "wgmma", "mma16")


def kernels_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The kernel names that take inputs of `dtype`: the f32 family or the 16-bit one."""
    return F32_KERNELS if dtype == torch.float32 else HALF_KERNELS


def check_kernel_choice(kernel: str, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Raise ValueError unless `kernel` takes `in_dtype` inputs and can write `out_dtype`.

    f32 inputs: kernel "auto" / "tf32x3" / "f32", any of the three out dtypes.
    bf16/fp16 inputs: kernel "auto" / "wgmma" / "mma16", out dtype = input dtype.
    """
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if out_dtype not in OUT_DTYPE_CHOICES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPE_CHOICES}, got {out_dtype}")
    family = kernels_for(in_dtype)
    if kernel not in family:
        raise ValueError(f"kernel={kernel!r} does not take {in_dtype} inputs; choose one of {family}")
    if in_dtype != torch.float32 and out_dtype != in_dtype:
        raise ValueError(f"the 16-bit kernels write their input dtype {in_dtype}, got out_dtype={out_dtype}")


_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def check_scale(scale: float) -> None:
    """Raise ValueError unless the logit scale is finite, positive, and its product
    with log2(e) (what the kernels multiply logits by) a normal float32."""
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    if not _F32_TINY <= scale / math.log(2.0) <= _F32_MAX:
        raise ValueError(f"scale={scale} is outside float32's normal range once multiplied by log2(e)")
