"""Launching the CUDA kernels through CuPy: compile cache, DLPack bridge, stream.

* Each kernel variant is compiled once per process and device by
  `cupy.RawModule` (NVRTC); CuPy's on-disk kernel cache makes later processes
  skip the compile.
* Tensors cross to CuPy through DLPack: zero copy, outputs allocated by torch.
* Kernels run on torch's *current* stream of the tensors' device, so they
  order with surrounding torch work and are captured by CUDA graphs. No call
  here synchronises with the host.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .kernel_sources import (
    F32_ROWS_PER_BLOCK,
    F32_THREADS,
    KernelVariant,
    f32_variant_for,
    read_source,
)
from .nvrtc import load_nvrtc_library

_DEFAULT_SHARED_LIMIT = 48 * 1024

CUPY_INSTALL_HINT = (
    "PictorAttn needs CuPy to run its kernels on CUDA tensors. Install the extra that matches "
    "your torch build: pip install 'pictor-diffusers[cuda12]' (CUDA 12) or "
    "'pictor-diffusers[cuda13]' (CUDA 13); never both."
)

_kernels: dict[tuple[str, int], Any] = {}
_streams: dict[tuple[int, int], Any] = {}
_lock = threading.Lock()


def import_cupy() -> Any:
    """Import CuPy, or raise ImportError that names the extra to install."""
    try:
        import cupy
    except ImportError as error:
        raise ImportError(CUPY_INSTALL_HINT) from error
    return cupy


def compiled_kernel(variant: KernelVariant, device_index: int) -> Any:
    """The loaded `cupy.RawKernel` of `variant` on `device_index`, compiled on first use."""
    cache_key = (variant.name, device_index)
    kernel = _kernels.get(cache_key)
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get(cache_key)
        if kernel is None:
            kernel = _load_kernel(variant, device_index)
            _kernels[cache_key] = kernel
    return kernel


def _load_kernel(variant: KernelVariant, device_index: int) -> Any:
    cupy = import_cupy()
    load_nvrtc_library()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=read_source(variant), options=variant.options())
        kernel = module.get_function(variant.entry)
        shared = variant.shared_bytes(variant.max_head_dim)
        if shared > _DEFAULT_SHARED_LIMIT:
            kernel.max_dynamic_shared_size_bytes = shared
        kernel.compile()
    return kernel


def _cupy_stream(cupy: Any, device: torch.device) -> Any:
    """CuPy's view of torch's current stream on `device` (cached per stream handle)."""
    torch_stream = torch.cuda.current_stream(device)
    cache_key = (device.index, torch_stream.cuda_stream)
    stream = _streams.get(cache_key)
    if stream is None:
        stream = cupy.cuda.Stream.from_external(torch_stream)
        _streams[cache_key] = stream
    return stream


class _SameStreamExport:
    """DLPack exporter for a tensor that the consumer uses on torch's current stream.

    torch's `__dlpack__` would otherwise record and wait on an event when the
    consumer names a stream; the launch below runs on torch's current stream,
    so no cross-stream ordering is needed (`stream=-1` tells torch so).
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self.tensor.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()


def flash_attention_f32_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `joint_attention_flash_f32` on validated CUDA inputs.

    Args:
        query, key, value: contiguous float32 `[B, H, N, D]` on one CUDA device.
        scale: logit scale.
        out: optional contiguous float32 `[B, N, H*D]` destination on the same
            device (the tests pass a NaN-poisoned buffer); torch allocates one if None.

    Returns:
        float32 `[B, N, H*D]` (token-major).
    """
    cupy = import_cupy()
    batch, heads, seq, head_dim = query.shape
    device = query.device
    variant = f32_variant_for(head_dim)
    out_shape = (batch, seq, heads * head_dim)
    if out is None:
        out = torch.empty(out_shape, dtype=torch.float32, device=device)
    elif out.shape != out_shape or out.dtype != torch.float32 or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 {out_shape} tensor on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    kernel = compiled_kernel(variant, device.index)
    grid = ((seq + F32_ROWS_PER_BLOCK - 1) // F32_ROWS_PER_BLOCK, heads, batch)
    with torch.cuda.device(device), cupy.cuda.Device(device.index), _cupy_stream(cupy, device):
        arrays = tuple(cupy.from_dlpack(_SameStreamExport(t)) for t in (query, key, value, out))
        scalars = (np.uint32(heads), np.uint32(seq), np.uint32(head_dim), np.float32(scale))
        kernel(grid, (F32_THREADS,), arrays + scalars, shared_mem=variant.shared_bytes(head_dim))
    return out
