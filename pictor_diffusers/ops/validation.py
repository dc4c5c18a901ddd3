"""Input checks for the attention entry point; every error names the actual value."""

from __future__ import annotations

import math
import numbers

import torch

from ..cuda.geometry import SplitPlanes, split_halves
from ..cuda.registry import MAX_HEAD_DIM
from ..dtypes import COMPUTE_DTYPES, DTYPE_NAMES

_MAX_GRID_YZ = 65535
MAX_SEQ = 2**31 - 1
"""Query and key counts the kernels index in signed 32 bits (TMA coordinates, row counters)."""
MAX_PLANES = (2**32 - 1) // (3 * 128)
"""B * H the parity path indexes in 32 bits: `(tensor * planes + plane) * 128` column maxima."""


def check_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise ValueError/TypeError unless q, k, v are valid head-major inputs.

    Valid means: three tensors on one CPU or CUDA device, one dtype out of
    float32 / bfloat16 / float16, rank 4, query `[B, H, Nq, D]` and key, value
    `[B, H, Nk, D]` (same B, H and D; Nq and Nk may differ), any strides,
    B, H, Nq, Nk >= 1, 1 <= D <= 384, B, H <= 65535 (the kernels' grid limits),
    Nq, Nk <= 2**31 - 1 and B * H <= `MAX_PLANES` (what the kernels index in 32 bits).
    """
    if _plainly_valid(query, key, value):
        return
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
        batch, heads, _, head_dim = query.shape
        if (tensor.shape[0], tensor.shape[1], tensor.shape[3]) != (batch, heads, head_dim):
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but query has {tuple(query.shape)}; "
                "batch, heads and head_dim must match"
            )
        if name == "value" and tensor.shape != key.shape:
            raise ValueError(f"value has shape {tuple(tensor.shape)} but key has {tuple(key.shape)}; they must match")
    _check_extents(*query.shape)
    if not 1 <= key.shape[2] <= MAX_SEQ:
        raise ValueError(f"key and value need 1 to {MAX_SEQ} tokens, got Nk={key.shape[2]}")


def check_key_lens(key_lens: torch.Tensor | None, query: torch.Tensor) -> None:
    """Raise ValueError/TypeError unless `key_lens` is None or a contiguous int32 `[B]` tensor on query's
    device (per-batch key counts; their values are clamped to [0, Nk] by the kernels, never read here)."""
    if key_lens is None:
        return
    if not isinstance(key_lens, torch.Tensor):
        raise TypeError(f"key_lens must be a torch.Tensor or None, got {type(key_lens).__name__}")
    if key_lens.dtype != torch.int32:
        raise TypeError(f"key_lens must be int32, got {key_lens.dtype}")
    if key_lens.shape != (query.shape[0],) or not key_lens.is_contiguous():
        raise ValueError(
            f"key_lens must be a contiguous [B] = [{query.shape[0]}] tensor, got shape {tuple(key_lens.shape)} "
            f"strides {tuple(key_lens.stride())}"
        )
    if key_lens.device != query.device:
        raise ValueError(f"key_lens is on {key_lens.device} but query is on {query.device}; all must share a device")


def check_key_bias(
    key_bias: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, key_lens: torch.Tensor | None
) -> None:
    """Raise ValueError/TypeError unless `key_bias` is None or a floating-point `[B, 1 or H, Nk]` tensor (any
    strides) on query's device, given without key counts (a bias of -inf drops a key, so counts fold into it)."""
    if key_bias is None:
        return
    if not isinstance(key_bias, torch.Tensor):
        raise TypeError(f"key_bias must be a torch.Tensor or None, got {type(key_bias).__name__}")
    if not key_bias.is_floating_point():
        raise TypeError(f"key_bias must be a floating-point tensor, got {key_bias.dtype}")
    batch, heads, seq_k = query.shape[0], query.shape[1], key.shape[2]
    if key_bias.dim() != 3 or key_bias.shape[::2] != (batch, seq_k) or key_bias.shape[1] not in (1, heads):
        raise ValueError(
            f"key_bias must be [B, 1 or H, Nk] = [{batch}, 1 or {heads}, {seq_k}], got shape {tuple(key_bias.shape)}"
        )
    if key_bias.device != query.device:
        raise ValueError(f"key_bias is on {key_bias.device} but query is on {query.device}; all must share a device")
    if key_lens is not None:
        raise ValueError("key_bias and key_lens cannot be given together: set the bias to -inf past each batch's keys")


def check_split_planes(split: SplitPlanes) -> None:
    """Raise TypeError/ValueError unless `split` is what the split prologue makes (the attention kernel reads
    it by these sizes, unchecked): contiguous 16-byte aligned float16 planes of `split_halves` elements and
    contiguous int32 column maxima `[3, B*H, D]` on one device, B*H a multiple of `heads`."""
    planes, colmax, heads, seq = split
    if planes.dtype != torch.float16 or colmax.dtype != torch.int32:
        raise TypeError(f"split planes must be float16 and their maxima int32, got {planes.dtype}, {colmax.dtype}")
    if colmax.dim() != 3 or colmax.shape[0] != 3 or heads < 1 or colmax.shape[1] % heads:
        raise ValueError(f"split maxima must be [3, B*H, D] with B*H a multiple of heads={heads}, got {colmax.shape}")
    _, groups, head_dim = colmax.shape
    _check_extents(groups // heads, heads, seq, head_dim)
    size = split_halves(groups, seq, seq, head_dim)
    if planes.shape != (size,) or not (planes.is_contiguous() and colmax.is_contiguous()) or planes.data_ptr() % 16:
        raise ValueError(
            f"split planes must be contiguous, 16-byte aligned and hold {size} values for B*H={groups}, N={seq}, "
            f"D={head_dim}; got shape {tuple(planes.shape)} at {planes.data_ptr():#x}"
        )
    if planes.device != colmax.device:
        raise ValueError(f"split planes are on {planes.device} but their maxima on {colmax.device}")


def _plainly_valid(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The common case in few operations (the host cost of every call); False sends the
    inputs through the detailed checks, which name what is wrong."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)):
        return False
    dtype, shape = query.dtype, query.shape
    if dtype not in DTYPE_NAMES or key.dtype != dtype or value.dtype != dtype or len(shape) != 4:
        return False
    key_shape = key.shape
    if len(key_shape) != 4 or value.shape != key_shape or not 1 <= key_shape[2] <= MAX_SEQ:
        return False
    if key_shape[0] != shape[0] or key_shape[1] != shape[1] or key_shape[3] != shape[3]:
        return False
    device = query.device
    if device.type not in ("cpu", "cuda") or key.device != device or value.device != device:
        return False
    batch, heads, seq, head_dim = shape
    return (
        1 <= min(batch, heads, seq)
        and max(batch, heads) <= _MAX_GRID_YZ
        and 1 <= head_dim <= MAX_HEAD_DIM
        and seq <= MAX_SEQ
        and batch * heads <= MAX_PLANES
    )


def _check_extents(batch: int, heads: int, seq: int, head_dim: int) -> None:
    if min(batch, heads, seq) < 1:
        raise ValueError(f"batch, heads and seq must be >= 1, got B={batch}, H={heads}, N={seq}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    if batch > _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
        raise ValueError(f"batch and heads must be <= {_MAX_GRID_YZ}, got B={batch}, H={heads}")
    if batch * heads > MAX_PLANES:
        raise ValueError(f"B * H must be <= {MAX_PLANES} (32-bit indexing), got B * H = {batch} * {heads}")
    if seq > MAX_SEQ:
        raise ValueError(f"query needs at most {MAX_SEQ} tokens (32-bit indexing), got Nq={seq}")


OUT_DTYPE_CHOICES = COMPUTE_DTYPES


_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38


def check_scale(scale: object) -> None:
    """Raise TypeError unless the logit scale is a real number (not a bool or a string), ValueError unless
    it is finite, positive, and its product with log2(e) (what the kernels multiply logits by) a normal
    float32."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {scale!r} of type {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a finite positive number, got {scale}")
    if not _F32_TINY <= scale / math.log(2.0) <= _F32_MAX:
        raise ValueError(f"scale={scale} is outside float32's normal range once multiplied by log2(e)")


def check_flag(name: str, value: object) -> None:
    """Raise TypeError unless `value` is a bool (so "no" or 0 never passes for a choice)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} of type {type(value).__name__}")
