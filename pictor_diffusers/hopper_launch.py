"""Launching the Hopper wgmma kernel: sm_90a cubin, tensor maps, driver launch.

`flash_attn_wgmma.cu` reads q, k and v through the bulk tensor copy engine, so
each input is described by a CUtensorMap that the host encodes
(`cuTensorMapEncodeTiled`, from the CUDA driver torch already loaded) and the
kernel takes by value. CuPy cannot pass a 128-byte struct through its kernel
call, so the launch goes through CuPy's binding of `cuLaunchKernel`, on torch's
current stream; the cubin comes from `nvrtc.cached_cubin` and is loaded by
`cupy.RawModule`. The tensor maps and the output pointer take torch's device
addresses directly (no DLPack round trip: this path is tuned for host
overhead); nothing is copied and nothing synchronises with the host.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import warnings
from typing import Any

import torch

from .cuda_launch import _device_limits, bind_context, import_cupy
from .kernel_sources import WGMMA_HEAD_DIMS, KernelVariant, wgmma_variant_for
from .nvrtc import cached_cubin, load_nvrtc_library

_LOG2_E = 1.0 / math.log(2.0)
_BOX_COLUMNS, _BOX_ROWS = 64, 128
_TENSOR_MAP_DTYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3

_MAP_CACHE_SIZE = 256

_functions: dict[tuple[str, int], tuple[Any, int]] = {}
_setup_problems: dict[tuple[int, torch.dtype], str | None] = {}
_maps: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[ctypes.Array, int]] = {}
_lock = threading.Lock()


class _TensorMap(ctypes.Structure):
    """CUtensorMap: 128 opaque bytes (the driver wants 64-byte alignment; see `_aligned_map`)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuTensorMapEncodeTiled.restype = ctypes.c_int
    driver.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    return driver


def _aligned_map() -> tuple[ctypes.Array, int]:
    """A 64-byte-aligned CUtensorMap slot: (owning buffer, address)."""
    buffer = ctypes.create_string_buffer(ctypes.sizeof(_TensorMap) + 64)
    address = (ctypes.addressof(buffer) + 63) & ~63
    return buffer, address


def _encode_head_major(pointer: int, shape: tuple[int, int, int, int], dtype: torch.dtype) -> tuple[ctypes.Array, int]:
    """Tensor map of a contiguous 16-bit `[B, H, N, D]` tensor as rank 3 (D, N, B*H).

    Box: 64 columns x 128 rows x 1 head, 128-byte swizzle; reads past N (or
    past the last head) are zero-filled by the copy engine.
    """
    batch, heads, seq, head_dim = shape
    buffer, address = _aligned_map()
    dims = (ctypes.c_uint64 * 3)(head_dim, seq, batch * heads)
    strides = (ctypes.c_uint64 * 2)(head_dim * 2, seq * head_dim * 2)
    box = (ctypes.c_uint32 * 3)(_BOX_COLUMNS, _BOX_ROWS, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    status = _driver().cuTensorMapEncodeTiled(
        address, _TENSOR_MAP_DTYPES[dtype], 3, pointer, dims, strides, box, unit, 0, _SWIZZLE_128B,
        _L2_PROMOTION_256B, 0,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for a {dtype} {shape} tensor")
    return buffer, address


def _tensor_map(pointer: int, shape: tuple[int, int, int, int], dtype: torch.dtype) -> tuple[ctypes.Array, int]:
    """`_encode_head_major`, memoised by (address, shape, dtype): a map holds nothing else,
    so it stays valid for whatever tensor lives there. The caller keeps the returned
    buffer alive until its launch."""
    cache_key = (pointer, shape, dtype)
    entry = _maps.get(cache_key)
    if entry is None:
        if len(_maps) >= _MAP_CACHE_SIZE:
            _maps.clear()
        entry = _maps[cache_key] = _encode_head_major(pointer, shape, dtype)
    return entry


def _setup_problem(device_index: int, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot be built, cached or loaded on this device (tried once), or None.

    Any failure there (an NVRTC without sm_90a, no writable cache, a driver
    without tensor maps) disables the kernel with its reason and a warning, so
    "auto" moves on to the next kernel.
    """
    cache_key = (device_index, dtype)
    if cache_key not in _setup_problems:
        problem = None
        try:
            _driver()
            _function(wgmma_variant_for(WGMMA_HEAD_DIMS[0], str(dtype).removeprefix("torch.")), device_index)
        except Exception as error:  # every failure is reported, and the path disabled
            problem = f"the wgmma kernel could not be prepared ({type(error).__name__}: {error})"
            warnings.warn(f"pictor-diffusers: {problem}; using the next kernel", RuntimeWarning, stacklevel=3)
        _setup_problems[cache_key] = problem
    return _setup_problems[cache_key]


def wgmma_blocker(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the Hopper wgmma kernel cannot take these CUDA inputs, or None if it can."""
    head_dim = query.shape[-1]
    if query.dtype not in _TENSOR_MAP_DTYPES:
        return f"dtype {query.dtype} is not bfloat16 or float16"
    tensors = (query, key, value)
    if any(t.dtype != query.dtype or t.shape != query.shape or not t.is_contiguous() for t in tensors):
        return "q, k and v must be contiguous with one shape and dtype"
    if head_dim not in WGMMA_HEAD_DIMS:
        return f"head_dim={head_dim} is not one of {WGMMA_HEAD_DIMS}"
    capability, shared_limit = _device_limits(query.device.index)
    if capability != (9, 0):
        return f"compute capability {capability} is not Hopper's 9.0 (wgmma needs sm_90a)"
    needed = wgmma_variant_for(head_dim, "bfloat16").shared_bytes(head_dim)
    if needed > shared_limit:
        return f"needs {needed} bytes of shared memory per block, the device allows {shared_limit}"
    if any(t.data_ptr() % 16 for t in tensors):
        return "q, k or v is not 16-byte aligned"
    return _setup_problem(query.device.index, query.dtype)


def _function(variant: KernelVariant, device_index: int) -> int:
    """The CUfunction handle of `variant` on `device_index`, compiled and loaded once."""
    cache_key = (variant.name, device_index)
    function = _functions.get(cache_key)
    if function is None:
        with _lock:
            function = _functions.get(cache_key)
            if function is None:
                cupy = import_cupy()
                load_nvrtc_library()
                with cupy.cuda.Device(device_index):
                    module = cupy.RawModule(path=str(cached_cubin(variant, variant.arch)))
                    kernel = module.get_function(variant.entry)
                    kernel.max_dynamic_shared_size_bytes = variant.shared_bytes(variant.max_head_dim)
                    function = (kernel, kernel.kernel.ptr)
                _functions[cache_key] = function
    return function[1]


def _launch_kernel(function: int, grid: tuple[int, int, int], variant: KernelVariant, stream: int, params: int) -> None:
    """cuLaunchKernel through CuPy's driver binding (raises CUDADriverError on failure)."""
    cupy = import_cupy()
    shared = variant.shared_bytes(variant.max_head_dim)
    cupy.cuda.driver.launchKernel(function, *grid, variant.threads, 1, 1, shared, stream, params, 0)


def flash_attention_wgmma_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `joint_attention_wgmma` on torch's current stream.

    Args:
        query, key, value: contiguous 16-byte-aligned bfloat16 or float16
            `[B, H, N, 128]` on one Hopper (sm_90) device; `wgmma_blocker` is None.
        scale: logit scale.
        out: optional contiguous `[B, N, H*128]` destination of the inputs' dtype.

    Returns:
        `[B, N, H*128]` (token-major) in the inputs' dtype.
    """
    from .cuda_launch import _check_out

    batch, heads, seq, head_dim = query.shape
    variant = wgmma_variant_for(head_dim, str(query.dtype).removeprefix("torch."))
    shape = (batch, seq, heads * head_dim)
    if out is None:
        out = torch.empty(shape, dtype=query.dtype, device=query.device)
    _check_out(out, shape, query.dtype, query.device)
    function = _function(variant, query.device.index)
    maps = [_tensor_map(t.data_ptr(), tuple(query.shape), query.dtype) for t in (query, key, value)]
    scalars = (
        ctypes.c_uint64(out.data_ptr()),
        ctypes.c_uint32(heads),
        ctypes.c_uint32(seq),
        ctypes.c_float(scale * _LOG2_E),
    )
    params = (ctypes.c_void_p * 7)(*(address for _, address in maps), *(ctypes.addressof(c) for c in scalars))
    grid = (-(-seq // variant.rows_per_block), heads, batch)
    with torch.cuda.device(query.device):
        bind_context(query.device.index)
        _launch_kernel(function, grid, variant, torch.cuda.current_stream().cuda_stream, ctypes.addressof(params))
    return out
