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

import functools
import math
import threading
from typing import Any

import numpy as np
import torch

from .kernel_sources import (
    TF32X3_HEAD_DIMS,
    KernelVariant,
    f32_variant_for,
    read_source,
    tf32x3_variant_for,
)
from .nvrtc import load_nvrtc_library

_DEFAULT_SHARED_LIMIT = 48 * 1024
_LOG2_E = 1.0 / math.log(2.0)

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


@functools.cache
def _device_limits(device_index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, opt-in shared memory bytes per block) of a device."""
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.shared_memory_per_block_optin


def tensor_core_blocker(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the tf32x3 kernel cannot take these CUDA inputs, or None if it can."""
    head_dim = query.shape[-1]
    if head_dim not in TF32X3_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {TF32X3_HEAD_DIMS}"
    capability, shared_limit = _device_limits(query.device.index)
    if capability < (8, 0):
        return f"compute capability {capability} has no TF32 tensor cores (needs 8.0+)"
    needed = tf32x3_variant_for(head_dim, "float32").shared_bytes(head_dim)
    if needed > shared_limit:
        return f"needs {needed} bytes of shared memory per block, the device allows {shared_limit}"
    misaligned = [name for name, t in zip("qkv", (query, key, value), strict=True) if t.data_ptr() % 16]
    if misaligned:
        return f"{', '.join(misaligned)} not 16-byte aligned"
    return None


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} {shape} tensor on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def _launch(
    variant: KernelVariant,
    tensors: tuple[torch.Tensor, ...],
    scalars: tuple[Any, ...],
    grid: tuple[int, int, int],
    shared_bytes: int,
) -> None:
    """Launch `variant` on torch's current stream of the tensors' device."""
    cupy = import_cupy()
    device = tensors[0].device
    kernel = compiled_kernel(variant, device.index)
    with torch.cuda.device(device), cupy.cuda.Device(device.index), _cupy_stream(cupy, device):
        arrays = tuple(cupy.from_dlpack(_SameStreamExport(_dlpack_view(t))) for t in tensors)
        kernel(grid, (variant.threads,), arrays + scalars, shared_mem=shared_bytes)


def _dlpack_view(tensor: torch.Tensor) -> torch.Tensor:
    """16-bit float tensors travel as int16 views: CuPy's bf16 needs ml_dtypes, the kernel needs bits."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.view(torch.int16)
    return tensor


def flash_attention_f32_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the scalar-FP32 reference kernel `joint_attention_flash_f32`.

    Args:
        query, key, value: contiguous float32 `[B, H, N, D]` on one CUDA device.
        scale: logit scale.
        out: optional contiguous float32 `[B, N, H*D]` destination on the same
            device (the tests pass a NaN-poisoned buffer); torch allocates one if None.

    Returns:
        float32 `[B, N, H*D]` (token-major).
    """
    batch, heads, seq, head_dim = query.shape
    variant = f32_variant_for(head_dim)
    shape = (batch, seq, heads * head_dim)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=query.device)
    _check_out(out, shape, torch.float32, query.device)
    grid = (-(-seq // variant.rows_per_block), heads, batch)
    scalars = (np.uint32(heads), np.uint32(seq), np.uint32(head_dim), np.float32(scale))
    _launch(variant, (query, key, value, out), scalars, grid, variant.shared_bytes(head_dim))
    return out


def flash_attention_tf32x3_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the 3xTF32 tensor-core kernel `joint_attention_tf32x3`.

    Args:
        query, key, value: contiguous 16-byte-aligned float32 `[B, H, N, D]` on one
            CUDA device of compute capability 8.0+, D in {32, 64, 96, 128}.
        scale: logit scale.
        out_dtype: float32, bfloat16 or float16; the kernel rounds into it once.
        out: optional contiguous `[B, N, H*D]` destination of `out_dtype`.

    Returns:
        `[B, N, H*D]` (token-major) in `out_dtype`.
    """
    batch, heads, seq, head_dim = query.shape
    variant = tf32x3_variant_for(head_dim, str(out_dtype).removeprefix("torch."))
    shape = (batch, seq, heads * head_dim)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=query.device)
    _check_out(out, shape, out_dtype, query.device)
    grid = (-(-seq // variant.rows_per_block), heads, batch)
    scalars = (np.uint32(heads), np.uint32(seq), np.float32(scale * _LOG2_E))
    _launch(variant, (query, key, value, out), scalars, grid, variant.shared_bytes(head_dim))
    return out
