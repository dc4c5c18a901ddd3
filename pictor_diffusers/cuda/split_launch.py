"""The fp16x3 kernel's operands: f32 q, k, v split into scaled float16 hi/lo planes, and a remembered call's
replay of the split and the kernel.

* `split_planes` runs the split kernel's two phases on a window's f32 q, k, v into a fresh workspace (planes and
  zeroed column maxima, `split_buffers`); `plane_operands` makes the kernel's operands of them (three tensor
  maps, the output's, LSE's and key counts' addresses, the column maxima's address).
* `split_qkv_cuda` splits whole contiguous q, k, v (`ops.split_route`'s unfused route).
* `SplitReplay` is `plan_memo`'s replay of an fp16x3 call: the split's two phases and the kernel, their
  arguments filled once for the workspace address the caching allocator hands back call after call. A run
  allocates the workspace as the full path does and launches only when its address is the remembered one
  (else the caller takes the full path), so no workspace is held between calls.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import nvrtc, runtime, tensor_maps
from .geometry import Geometry, Launch, SplitPlanes, split_halves
from .pass_rows import SPLIT, split_variant

_U32, _U64 = ctypes.c_uint32, ctypes.c_uint64
SPLIT_SIGNATURE = (_U64,) * 5 + (_U32,) * 5
"""The split kernel's arguments: q, k, v, planes and column maxima addresses; q_count, k_count, q_pitch,
kv_pitch; the phase."""
_BOX_ROWS = 64
"""Rows per tensor-map box of a split plane."""


def split_buffers(
    groups: int, q_rows: int, k_rows: int, head_dim: int, device_index: int, one_allocation: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split planes (float16, flat, `geometry.split_halves`) and zeroed column maxima (int32 `[3, groups, D]`)
    on the device: views of one allocation where `one_allocation` (a custom op's outputs may not alias)."""
    halves, device = split_halves(groups, q_rows, k_rows, head_dim), runtime.cuda_device(device_index)
    if one_allocation:
        workspace = torch.empty(halves + 6 * groups * head_dim, dtype=torch.float16, device=device)
        planes, colmax = workspace[:halves], workspace[halves:].view(torch.int32).view(3, groups, head_dim)
    else:
        planes = torch.empty(halves, dtype=torch.float16, device=device)
        colmax = torch.empty((3, groups, head_dim), dtype=torch.int32, device=device)
    runtime.zero(colmax.data_ptr(), colmax.numel() * 4, device_index)
    return planes, colmax


def two_phases(
    function: int, device_index: int, grid: tuple[int, int, int], threads: int, signature: tuple[Any, ...],
    args: tuple[Any, ...],
) -> None:  # fmt: skip
    """Launch a two-phase entry (the split's, the split prologue's): `args`, then phase 0 and phase 1."""
    for phase in (0, 1):
        runtime.launch(function, device_index, grid, threads, 0, signature, (*args, phase))


def _split_args(
    pointers: tuple[int, int, int], geometry: Geometry, planes: torch.Tensor, colmax: torch.Tensor
) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The split kernel's grid and arguments (without the phase) for q, k, v at `pointers`."""
    g = geometry
    grid = (g.planes, -(-max(g.q_count, g.k_count) // SPLIT.rows_per_block), 3)
    return grid, (*pointers, planes.data_ptr(), colmax.data_ptr(), g.q_count, g.k_count, g.q_pitch, g.kv_pitch)


def split_planes(
    pointers: tuple[int, int, int], geometry: Geometry, device_index: int, function: int, one_allocation: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's f32 q, k, v (first-row addresses, `geometry`) as scaled float16 hi/lo planes,
    by the split kernel's two phases (`function`: its loaded `CUfunction` handle, `pass_rows.split_variant`'s).

    Returns the planes (float16, flat: q's `[2 (hi, lo), planes, q_count, D]`, then k's and v's,
    each `[2, planes, k_count, D]`) and the column maxima `[3, planes, D]` (f32 bit patterns as
    int32) that give each group's scale, views of one allocation unless not `one_allocation`.
    """
    g = geometry
    planes, colmax = split_buffers(g.planes, g.q_count, g.k_count, g.head_dim, device_index, one_allocation)
    grid, args = _split_args(pointers, g, planes, colmax)
    two_phases(function, device_index, grid, SPLIT.threads, SPLIT_SIGNATURE, args)
    return planes, colmax


def split_qkv_cuda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, one_allocation: bool = True
) -> SplitPlanes:
    """Contiguous float32 q, k, v `[B, H, N, D]` on CUDA (D = 128) through the split kernel: the planes the
    fp16x3 kernel reads (`split_planes` on all rows; `one_allocation` as there)."""
    batch, heads, seq, head_dim = query.shape
    device_index = query.device.index
    geometry = Geometry(batch * heads, seq, seq, seq, seq, head_dim, torch.float32, heads, 0.0)
    function = nvrtc.function(split_variant(head_dim), device_index)
    pointers = (query.data_ptr(), key.data_ptr(), value.data_ptr())
    planes, colmax = split_planes(pointers, geometry, device_index, function, one_allocation)
    return SplitPlanes(planes, colmax, heads, seq)


def _plane_rows(address: int, planes: int, rows: int, head_dim: int) -> tensor_maps.Planes:
    """The split's hi then lo planes of one tensor, `[2 * planes, rows, head_dim]` float16 at `address`,
    as `2 * planes` heads of one batch."""
    return tensor_maps.Planes(address, 2 * planes, rows, 1, rows * head_dim, head_dim, 2 * planes * rows * head_dim)


def plane_operands(
    planes: torch.Tensor, colmax: torch.Tensor, geometry: Geometry, addresses: tuple[int, ...]
) -> tuple[tuple[Any, ...], list[tuple[Any, int]]]:
    """The fp16x3 kernel's operands (q, k, v plane maps, `addresses` (out, lse, key counts), the column
    maxima's address) and the maps, which must stay referenced until the launch is issued."""
    g, base, half = geometry, planes.data_ptr(), 2
    q_bytes = 2 * g.planes * g.q_count * g.head_dim * half
    k_bytes = 2 * g.planes * g.k_count * g.head_dim * half
    maps = [
        tensor_maps.map_at(_plane_rows(address, g.planes, count, g.head_dim), g.head_dim, torch.float16, _BOX_ROWS)
        for address, count in ((base, g.q_count), (base + q_bytes, g.k_count), (base + q_bytes + k_bytes, g.k_count))
    ]
    return (*(address for _, address in maps), *addresses, colmax.data_ptr()), maps


class SplitReplay:
    """A remembered fp16x3 call: the split's two phases and the kernel, arguments filled once.

    `build(geometry, workspace)` gets the planes and column maxima (`split_buffers`, one allocation) and
    returns the kernel's `Launch` on them. `run(out_pointer)` allocates the workspace again and, when the
    caching allocator hands back the remembered address, zeroes the maxima and launches the split and the
    kernel into `out_pointer`; it returns whether it ran (False: the caller takes the full path).
    """

    __slots__ = ("_address", "_attention", "_colmax", "_device", "_elements", "_phases")

    def __init__(self, pointers: tuple[int, int, int], geometry: Geometry, device_index: int, split_function: int,
                 function: int, out_index: int, build: Any) -> None:  # fmt: skip
        g = geometry
        planes, colmax = split_buffers(g.planes, g.q_count, g.k_count, g.head_dim, device_index, True)
        self._device, self._address = runtime.cuda_device(device_index), planes.data_ptr()
        self._elements = planes.numel() + 2 * colmax.numel()
        self._colmax = (colmax.data_ptr(), colmax.numel() * 4, device_index)
        grid, args = _split_args(pointers, g, planes, colmax)
        self._phases = tuple(
            runtime.PreparedLaunch(
                split_function, Launch(device_index, grid, SPLIT.threads, 0, SPLIT_SIGNATURE, (*args, p), None)
            )
            for p in (0, 1)
        )
        self._attention = runtime.PreparedLaunch(function, build(planes, colmax), out_index)

    def run(self, out_pointer: int) -> bool:
        workspace = torch.empty(self._elements, dtype=torch.float16, device=self._device)
        if workspace.data_ptr() != self._address:
            return False
        runtime.zero(*self._colmax)
        for phase in self._phases:
            phase.run()
        return self._attention.run(out_pointer)
