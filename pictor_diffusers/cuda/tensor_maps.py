"""TMA tensor maps (`CUtensorMap`) of strided `[B, H, N, D]` 16-bit tensors (and of the 8-bit kernel's
byte codes), for the Hopper kernels.

A map is 128 opaque bytes encoded by the driver (`cuTensorMapEncodeTiled`,
through ctypes) that the kernel takes by value (`__grid_constant__`). A map
holds only an address, a shape and strides, so it stays valid for whatever
tensor later lives at that address: maps are memoised by (address, extents,
strides, head_dim, dtype, box rows) in a cache bounded at `CACHE_SIZE` entries, the oldest evicted first.
Head-major `[B, H, N, D]` and token-major `[B, N, H, D]` (as a `[B, H, N, D]` view) differ only in strides.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

BOX_BYTES, BOX_ROWS = 128, 128
"""One copy: 128 bytes of D (the swizzle span: 64 16-bit or 128 8-bit columns) x 1 head x 128 rows (by
default: the 8-bit kernel's tiles; the wgmma kernel's Q box has its build's rows per block,
`Variant.rows_per_block`, its K and V boxes the build's keys per key tile, `Variant.key_rows`) x 1 batch."""
STORE_BOX_ROWS = 64
"""Rows of an output map's box: one consumer warpgroup's share of a work tile (64 of its 128 or 192 rows)."""
_DTYPES = {torch.float16: 6, torch.bfloat16: 9, torch.uint8: 0}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16 / _UINT8
_FLOAT32, _SWIZZLE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B = 7, 0, 3, 3
CACHE_SIZE = 256


class Planes(NamedTuple):
    """Where a window of rows of a strided `[B, H, N, D]` tensor lies: its first row's address
    (16-byte aligned), the extents and the strides of heads, rows and batches, in elements (each a
    multiple of 16 bytes; D is contiguous)."""

    pointer: int
    heads: int
    rows: int
    batches: int
    head_stride: int
    row_stride: int
    batch_stride: int


_maps: OrderedDict[tuple[Any, ...], tuple[ctypes.Array, int]] = OrderedDict()
_lock = threading.Lock()
_UNUSED_BUFFER = ctypes.create_string_buffer(128 + 64)
_UNUSED_MAP = (_UNUSED_BUFFER, (ctypes.addressof(_UNUSED_BUFFER) + 63) & ~63)


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


def _encode(planes: Planes, head_dim: int, dtype: torch.dtype, box_rows: int) -> tuple[ctypes.Array, int]:
    """Map of `planes` as rank 4 (head_dim, heads, rows, batches), box 128 bytes x 1 x `box_rows` x 1,
    128-byte swizzle; reads past `rows` are zero-filled by the copy engine."""
    size = dtype.itemsize
    dims = (head_dim, planes.heads, planes.rows, planes.batches)
    strides = (size * planes.head_stride, size * planes.row_stride, size * planes.batch_stride)
    box = (BOX_BYTES // size, 1, box_rows, 1)
    return _encoded(_DTYPES[dtype], planes.pointer, dims, strides, box, _SWIZZLE_128B, f"{dtype} {planes}")


def _encoded(
    dtype_code: int, pointer: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
    swizzle: int, what: str,
) -> tuple[ctypes.Array, int]:  # fmt: skip
    """A map encoded by the driver: (owning buffer, 64-byte-aligned map address). `strides` in bytes, of every
    dimension but the first (contiguous)."""
    buffer = ctypes.create_string_buffer(128 + 64)
    address = (ctypes.addressof(buffer) + 63) & ~63
    rank = len(dims)
    status = _driver().cuTensorMapEncodeTiled(
        address, dtype_code, rank, pointer, (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*(1,) * rank), 0, swizzle, _L2_PROMOTION_256B, 0,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for {what}")
    return buffer, address


def rows_of(tensor: torch.Tensor, start: int, stop: int) -> Planes:
    """`Planes` of rows [start, stop) of a strided `[B, H, N, D]` tensor. A dimension of extent 1 gets
    stride 8 (torch gives such dimensions arbitrary strides; the copy engine never steps along them)."""
    batch, heads, rows, _ = tensor.shape
    batch_stride, head_stride, row_stride, _ = tensor.stride()
    pointer = tensor.data_ptr() + start * row_stride * tensor.element_size()
    return Planes(
        pointer, heads, stop - start, batch,
        head_stride if heads > 1 else 8, row_stride if rows > 1 else 8, batch_stride if batch > 1 else 8,
    )  # fmt: skip


def out_planes(out: torch.Tensor, heads: int, start: int, stop: int) -> Planes:
    """`Planes` of rows [start, stop) of a contiguous token-major `[B, N, H*D]` output, seen as `[B, H, N, D]`
    (what `rows_of` gives that view, extent-1 rule included; from the extents alone, no view made: this runs on
    every launch)."""
    batch, rows, width = out.shape
    pointer = out.data_ptr() + start * width * out.element_size()
    return Planes(
        pointer, heads, stop - start, batch,
        width // heads if heads > 1 else 8, width if rows > 1 else 8, rows * width if batch > 1 else 8,
    )  # fmt: skip


def readable(tensor: torch.Tensor) -> bool:
    """Whether TMA can read the 16-bit `[B, H, N, D]` `tensor` in place: D contiguous, a 16-byte-aligned
    start, and every other stride of a dimension longer than 1 a positive multiple of 16 bytes (as
    head-major and token-major layouts are when D is a multiple of 8; broadcast, stride-0 views are not)."""
    batch, heads, rows, _ = tensor.shape
    batch_stride, head_stride, row_stride, column_stride = tensor.stride()
    if column_stride != 1 or tensor.data_ptr() % 16:
        return False
    strides = [
        stride for extent, stride in ((batch, batch_stride), (heads, head_stride), (rows, row_stride)) if extent > 1
    ]
    return all(stride > 0 and stride % 8 == 0 for stride in strides)


def map_at(planes: Planes, head_dim: int, dtype: torch.dtype, box_rows: int = BOX_ROWS) -> tuple[ctypes.Array, int]:
    """The memoised map of `planes` (see `_encode`)."""
    key = (planes, head_dim, dtype, box_rows)
    entry = _maps.get(key)
    return entry if entry is not None else _remember(key, _encode(*key))


def bias_map_at(bias: torch.Tensor, box_keys: int) -> tuple[ctypes.Array, int]:
    """The memoised map of a contiguous float32 key bias `[B*H, k_pad]` (`plan.log2_key_bias`'s), for the
    wgmma kernel's key-bias builds: rank 2 (k_pad keys, B*H planes), box `box_keys` x 1, no swizzle."""
    planes, keys = bias.shape
    key = ("key_bias", bias.data_ptr(), keys, planes, box_keys)
    entry = _maps.get(key)
    if entry is None:
        what = f"a key bias of {planes} planes x {keys} keys at {bias.data_ptr():#x}"
        entry = _remember(key, _encoded(_FLOAT32, key[1], key[2:4], (4 * keys,), (box_keys, 1), _SWIZZLE_NONE, what))
    return entry


def unused_map() -> tuple[ctypes.Array, int]:
    """128 zero bytes, 64-byte aligned: the map operand of a build that never reads it (a wgmma build without
    a key bias)."""
    return _UNUSED_MAP


def _remember(key: tuple[Any, ...], entry: tuple[ctypes.Array, int]) -> tuple[ctypes.Array, int]:
    with _lock:
        _maps[key] = entry
        while len(_maps) > CACHE_SIZE:
            _maps.popitem(last=False)
    return entry


def cached_maps() -> int:
    """How many maps the cache holds (for the soak tests)."""
    return len(_maps)
