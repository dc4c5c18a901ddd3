"""TMA tensor maps (`CUtensorMap`) of head-major 16-bit tensors, for the Hopper kernels.

A map is 128 opaque bytes encoded by the driver (`cuTensorMapEncodeTiled`,
through ctypes) that the kernel takes by value (`__grid_constant__`). A map
holds only an address, a shape and strides, so it stays valid for whatever
tensor later lives at that address: maps are memoised by (address, planes,
rows, pitch, head_dim, dtype, box rows) in a cache bounded at `CACHE_SIZE` entries, the oldest evicted first.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict

import torch

BOX_COLUMNS, BOX_ROWS = 64, 128
"""One copy: 64 head_dim columns (128 bytes, the swizzle span) x 128 rows (by default) x 1 head."""
_DTYPES = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B, _L2_PROMOTION_256B = 3, 3
CACHE_SIZE = 256

_maps: OrderedDict[tuple[int, int, int, int, int, torch.dtype, int], tuple[ctypes.Array, int]] = OrderedDict()
_lock = threading.Lock()


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


def check_driver() -> None:
    """Raise OSError if the driver library (and so tensor-map encoding) is unavailable."""
    _driver()


def _encode(
    pointer: int, planes: int, rows: int, pitch: int, head_dim: int, dtype: torch.dtype, box_rows: int
) -> tuple[ctypes.Array, int]:
    """Map of `planes` head-major 16-bit planes of `rows` x `head_dim`, `pitch` rows apart, as
    rank 3 (head_dim, rows, planes).

    128-byte swizzle; reads past `rows` (or past the last plane) are zero-filled by
    the copy engine. Returns (owning buffer, 64-byte-aligned map address).
    """
    buffer = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(buffer) + 63) & ~63
    dims = (ctypes.c_uint64 * 3)(head_dim, rows, planes)
    strides = (ctypes.c_uint64 * 2)(head_dim * 2, pitch * head_dim * 2)
    box = (ctypes.c_uint32 * 3)(BOX_COLUMNS, box_rows, 1)
    unit = (ctypes.c_uint32 * 3)(1, 1, 1)
    status = _driver().cuTensorMapEncodeTiled(
        address, _DTYPES[dtype], 3, pointer, dims, strides, box, unit, 0, _SWIZZLE_128B, _L2_PROMOTION_256B, 0
    )
    if status != 0:
        raise RuntimeError(
            f"cuTensorMapEncodeTiled failed with CUresult {status} for {planes} {dtype} planes of "
            f"{rows} x {head_dim} ({pitch} rows apart) at {pointer:#x}"
        )
    return buffer, address


def tensor_map(tensor: torch.Tensor, box_rows: int = BOX_ROWS) -> tuple[ctypes.Array, int]:
    """(owning buffer, address) of the map of a contiguous 16-bit `[B, H, N, D]` CUDA tensor,
    copied in boxes of 64 columns x `box_rows` rows.

    The caller keeps the buffer referenced until the launch has been issued
    (the launch copies the map's bytes).
    """
    batch, heads, seq, head_dim = tensor.shape
    return map_at(tensor.data_ptr(), batch * heads, seq, seq, head_dim, tensor.dtype, box_rows)


def map_at(
    pointer: int, planes: int, rows: int, pitch: int, head_dim: int, dtype: torch.dtype, box_rows: int = BOX_ROWS
) -> tuple[ctypes.Array, int]:
    """`tensor_map` of `rows` rows of each of `planes` head-major planes whose first row is at device
    address `pointer` (16-byte aligned) and which lie `pitch` rows apart: a window of rows of a
    `[B, H, pitch, D]` tensor, with no view needed."""
    key = (pointer, planes, rows, pitch, head_dim, dtype, box_rows)
    entry = _maps.get(key)
    if entry is not None:
        return entry
    entry = _encode(*key)
    with _lock:
        _maps[key] = entry
        while len(_maps) > CACHE_SIZE:
            _maps.popitem(last=False)
    return entry


def cached_maps() -> int:
    """How many maps the cache holds (for the soak tests)."""
    return len(_maps)
