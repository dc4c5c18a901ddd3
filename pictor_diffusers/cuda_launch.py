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
    MMA16_HEAD_DIMS,
    TF32X3_HEAD_DIMS,
    KernelVariant,
    f32_variant_for,
    mma16_variant_for,
    prologue_variant_for,
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
_thread_state = threading.local()


def import_cupy() -> Any:
    """Import CuPy, or raise ImportError that names the extra to install."""
    try:
        import cupy
    except ImportError as error:
        raise ImportError(CUPY_INSTALL_HINT) from error
    return cupy


def bind_context(device_index: int) -> None:
    """Make the device's primary CUDA context current in this thread (once per thread).

    Driver-level launches need a current context; a thread that has only used
    torch's cached allocations may not have one yet. cudaSetDevice binds it.
    """
    bound = getattr(_thread_state, "devices", None)
    if bound is None:
        bound = _thread_state.devices = set()
    if device_index not in bound:
        import_cupy().cuda.runtime.setDevice(device_index)
        bound.add(device_index)


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


def mma16_blocker(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the portable 16-bit mma.sync kernel cannot take these CUDA inputs, or None if it can."""
    head_dim = query.shape[-1]
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {query.dtype} is not bfloat16 or float16"
    if head_dim not in MMA16_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {MMA16_HEAD_DIMS}"
    capability, shared_limit = _device_limits(query.device.index)
    if capability < (8, 0):
        return f"compute capability {capability} has no bf16 mma.sync tensor cores (needs 8.0+)"
    needed = mma16_variant_for(head_dim, "bfloat16").shared_bytes(head_dim)
    if needed > shared_limit:
        return f"needs {needed} bytes of shared memory per block, the device allows {shared_limit}"
    if any(t.data_ptr() % 16 for t in (query, key, value)):
        return "q, k or v is not 16-byte aligned"
    return None


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} {shape} tensor on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.data_ptr() % 16:
        raise ValueError(f"out must be 16-byte aligned, got address {out.data_ptr():#x} (a view with an offset?)")


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
        bind_context(device.index)
        arrays = tuple(cupy.from_dlpack(_SameStreamExport(_dlpack_view(t))) for t in tensors)
        kernel(grid, (variant.threads,), arrays + scalars, shared_mem=shared_bytes)


def _dlpack_view(tensor: torch.Tensor) -> torch.Tensor:
    """Detached (kernels are inference-only; DLPack refuses tensors that require grad);
    16-bit floats as int16 views, since CuPy's bf16 needs ml_dtypes and the kernels read bits."""
    tensor = tensor.detach()
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
    needed, allowed = variant.shared_bytes(variant.max_head_dim), _device_limits(query.device.index)[1]
    if needed > allowed:
        raise ValueError(
            f"head_dim={head_dim} needs the {variant.name} kernel with {needed} bytes of shared memory "
            f"per block; {query.device} allows {allowed}"
        )
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


def flash_attention_mma16_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the portable 16-bit tensor-core kernel `joint_attention_mma16`.

    Args:
        query, key, value: contiguous 16-byte-aligned bfloat16 or float16
            `[B, H, N, D]` on one CUDA device of compute capability 8.0+, D in {64, 128}.
        scale: logit scale.
        out: optional contiguous `[B, N, H*D]` destination of the inputs' dtype.

    Returns:
        `[B, N, H*D]` (token-major) in the inputs' dtype.
    """
    batch, heads, seq, head_dim = query.shape
    variant = mma16_variant_for(head_dim, _IN_DTYPES[query.dtype])
    shape = (batch, seq, heads * head_dim)
    if out is None:
        out = torch.empty(shape, dtype=query.dtype, device=query.device)
    _check_out(out, shape, query.dtype, query.device)
    grid = (-(-seq // variant.rows_per_block), heads, batch)
    scalars = (np.uint32(heads), np.uint32(seq), np.float32(scale * _LOG2_E))
    _launch(variant, (query, key, value, out), scalars, grid, variant.shared_bytes(head_dim))
    return out


_IN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def prologue_blocker(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> str | None:
    """Why `qkv_prologue` cannot take this layout (the caller then runs torch), or None.

    The kernel reads 4-element vectors, so every row and batch stride must be a
    multiple of 4 elements and every base 4-element aligned; q/k/v of a segment
    share strides; all projections share one dtype; text and image norms share eps.
    """
    shape_problem = _prologue_shape_problem(projections, weights, rope)
    if shape_problem is not None:
        return shape_problem
    head_dim = weights[0].shape[0]
    dtype = projections[0].dtype
    if dtype not in _IN_DTYPES or any(p.dtype != dtype for p in projections):
        return f"projection dtypes {sorted({str(p.dtype) for p in projections})} are not one of f32/bf16/f16"
    if head_dim % 4 or head_dim > 128:
        return f"head_dim={head_dim} is not a multiple of 4 up to 128"
    if eps[0] != eps[2] or eps[1] != eps[3]:
        return f"text and image QK norms use different eps {eps}"
    vector_bytes = 4 * projections[0].element_size()
    for segment in (projections[:3], projections[3:]):
        if any(p.stride() != segment[0].stride() for p in segment) or segment[0].stride(-1) != 1:
            return "q, k, v projections of a segment have different or non-unit last strides"
        if any(s % 4 for s in segment[0].stride()[:2]) or any(p.data_ptr() % vector_bytes for p in segment):
            return "projection rows are not 4-element aligned"
    if any(t.data_ptr() % 16 for t in (*weights, *rope)):
        return "norm weights or rope tables are not 16-byte aligned"
    return None


def _prologue_shape_problem(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor]
) -> str | None:
    """Shapes, devices and dtypes the kernel relies on without checking them itself."""
    device = projections[3].device
    if any(t.device != device for t in (*projections, *weights, *rope)):
        return "projections, norm weights and rope tables are not all on one device"
    head_dim = weights[0].shape[0] if weights[0].dim() == 1 else 0
    if any(w.shape != (head_dim,) or w.dtype != torch.float32 or not w.is_contiguous() for w in weights):
        return f"norm weights must be contiguous float32 [{head_dim}]"
    if any(p.dim() != 3 for p in projections):
        return "projections must be [B, n, H*D]"
    batch, width = projections[3].shape[0], projections[3].shape[2]
    if head_dim == 0 or width % head_dim or any(p.shape[0] != batch or p.shape[2] != width for p in projections):
        return f"projections differ in batch or width, or width is not a multiple of head_dim={head_dim}"
    if any(p.shape[1] != seg[0].shape[1] for seg in (projections[:3], projections[3:]) for p in seg):
        return "q, k and v of a segment differ in token count"
    seq = projections[0].shape[1] + projections[3].shape[1]
    if rope and (len(rope) != 2 or any(r.shape != (seq, head_dim) or r.dtype != torch.float32 for r in rope)):
        return f"rope tables must be two float32 [{seq}, {head_dim}] tensors"
    if rope and not all(r.is_contiguous() for r in rope):
        return "rope tables are not contiguous"
    return None


def qkv_prologue_cuda(
    projections: list[torch.Tensor],
    weights: list[torch.Tensor],
    rope: list[torch.Tensor],
    eps: list[float],
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run `qkv_prologue` on a layout `prologue_blocker` accepted.

    Args:
        projections: [q_txt, k_txt, v_txt, q_img, k_img, v_img], each `[B, n, H*D]`
            in the model dtype (strided views allowed; n_txt may be 0).
        weights: f32 `[D]` norm weights [q_txt, k_txt, q_img, k_img].
        rope: [cos, sin], f32 contiguous `[N, D]`, or [] for no RoPE.
        eps: the four norms' eps.
        out_dtype: float32, bfloat16 or float16 for the outputs.

    Returns:
        q, k, v: contiguous `[B, H, N, D]` in `out_dtype`.
    """
    head_dim = weights[0].shape[0]
    text, image = projections[0], projections[3]
    batch, text_len, seq = image.shape[0], text.shape[1], text.shape[1] + image.shape[1]
    heads = image.shape[-1] // head_dim
    outs = tuple(torch.empty((batch, heads, seq, head_dim), dtype=out_dtype, device=image.device) for _ in range(3))
    variant = prologue_variant_for(head_dim, _IN_DTYPES[image.dtype], _IN_DTYPES[out_dtype])
    if text_len == 0:
        projections = [*projections[3:], *projections[3:]]
    rope_tensors = tuple(rope) if rope else (weights[0], weights[0])
    strides = (text.stride(1), text.stride(0), image.stride(1), image.stride(0))
    scalars = (
        *(np.uint64(s) for s in strides),
        np.uint32(text_len),
        np.uint32(seq),
        np.uint32(heads),
        np.float32(eps[2]),
        np.float32(eps[3]),
        np.int32(bool(rope)),
    )
    tensors = (*projections, *weights, *rope_tensors, *outs)
    _launch(variant, tensors, scalars, (seq, batch, 1), 0)
    return outs
