"""The one launch path: execute an attention plan, or launch a prologue.

`run` executes the `plan.AttentionPlan` that `plan.plan_attention` (or, on split planes,
`plan.plan_split_attention`) resolved (every attention kernel of the registry, or SDPA's call where "auto"
hands one to it); `qkv_prologue_cuda` launches the prologue, `qkv_prologue_split_cuda` the split prologue
(projections to the fp16x3 kernel's planes) and `split_qkv_cuda` the split on whole f32 q, k, v. Each builds
the kernel's argument list from its registry row and hands it to `runtime.launch`. A plan comes with its
kernel and prepass loaded, so running it looks nothing up. Inputs were validated at the public boundary
(`ops.attention`, `ops.split_route`); nothing here re-checks them.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..dtypes import DTYPE_NAMES
from . import nvrtc, runtime, tensor_maps
from .geometry import LOG2_E, OUT_MAP_OPERAND, OUT_OPERAND, Geometry, Launch, SplitPlanes, Window, split_halves
from .pass_rows import SPLIT, prologue_split_variant, prologue_variant, split_variant
from .plan import AttentionPlan
from .prologue_layout import PrologueLayout
from .quantized import quantized_operands
from .registry import KernelSpec

_U32, _U64, _F32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_SCALAR_TYPES = {
    "heads": _U32, "seq_q": _U32, "seq_k": _U32, "q_pitch": _U32, "kv_pitch": _U32, "out_pitch": _U32,
    "head_dim": _U32, "scale": _F32, "scale_log2": _F32, "batch": _U32,
}  # fmt: skip


def run(plan: AttentionPlan) -> torch.Tensor:
    """Execute a plan: the kernel's launch (or SDPA's call) into the plan's output, then the dtype cast the
    caller asked for; returns the caller's output."""
    window = plan.window
    if plan.selection.variant is None:
        return _sdpa_attention(plan.query, plan.key, plan.value, plan.scale, plan.out, window)
    launch_attention(plan)
    if plan.written.dtype == plan.out_dtype:
        return plan.written
    if plan.out is None:
        return plan.written.to(plan.out_dtype)
    rows = slice(window.q_start, window.q_stop)
    plan.out[:, rows].copy_(plan.written[:, rows])
    return plan.out


def _sdpa_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, out: torch.Tensor | None, window: Window
) -> torch.Tensor:
    """The window's rows by torch's `scaled_dot_product_attention` (16-bit inputs on a device where it is
    faster than pictor's kernels), token-major `[B, Nq, H*D]`, written into `out` when given."""
    rows, keys = slice(window.q_start, window.q_stop), slice(window.k_start, window.k_stop)
    result = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, rows], key[:, :, keys], value[:, :, keys], scale=scale
    )
    batch, heads, count, head_dim = result.shape
    token_major = result.transpose(1, 2).reshape(batch, count, heads * head_dim)
    if out is None:
        return token_major
    out[:, rows].copy_(token_major)
    return out


def launch_attention(plan: AttentionPlan, written: torch.Tensor | None = None) -> None:
    """Launch the plan's kernel variant (after the prepass that makes its operands, where it has one and the
    plan's q, k, v are not split already) into `plan.written` (or `written`, a replayed plan's fresh output),
    for the rows of its window (and `key_lens` keys of each batch, if given): its prepared `plan.launch` where
    it has one (`plan_memo`), with the output's address, else the launch `attention_launch` builds. Every
    attention kernel launch goes through here."""
    if plan.launch is not None:
        plan.launch.run((plan.written if written is None else written).data_ptr())
        return
    launch = attention_launch(plan)
    runtime.launch(plan.function, launch.device_index, launch.grid, launch.threads, launch.shared_bytes,
                   launch.signature, launch.args)  # fmt: skip


def prepare(plan: AttentionPlan) -> runtime.PreparedLaunch:
    """The plan's launch with its arguments filled once, for `plan_memo` to replay into a new output (the
    wgmma kernel's through a map of that output)."""
    tensor_maps_kind = plan.selection.variant.spec.operands == "tensor_maps"
    out_map = (OUT_MAP_OPERAND, _out_map_at(plan)) if tensor_maps_kind else None
    return runtime.PreparedLaunch(plan.function, attention_launch(plan), OUT_OPERAND, out_map)


def _out_map_at(plan: AttentionPlan) -> Callable[[int], tuple[ctypes.Array, int]]:
    """The map of the plan's output window (`tensor_maps.STORE_BOX_ROWS`-row boxes) whose first row is at a
    given address (the kernel's output operand: the plan's `written`, or a replay's fresh output)."""
    window, written, heads = plan.window, plan.written, plan.query.shape[1]
    planes = tensor_maps.out_planes(written, heads, window.q_start, window.q_stop)
    head_dim, dtype = written.shape[2] // heads, written.dtype

    def map_at(address: int) -> tuple[ctypes.Array, int]:  # holds no tensor: a memo entry keeps none alive
        return tensor_maps.map_at(planes._replace(pointer=address), head_dim, dtype, tensor_maps.STORE_BOX_ROWS)

    return map_at


def attention_launch(plan: AttentionPlan, workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launch:
    """The launch of the plan's kernel variant, its arguments built (running the prepass first, where its
    operands need one and the plan's q, k, v are not split already; a split-planes kernel given `workspace`, the
    planes and column maxima of `split_buffers`, reads them there instead, the prepass left to the caller)."""
    variant, window = plan.selection.variant, plan.window
    out, lse, key_lens = plan.written, plan.lse, plan.key_lens
    spec = variant.spec
    g, inputs = launch_geometry(plan)
    pointers = (
        *inputs,
        out.data_ptr() + window.q_start * g.heads * g.head_dim * out.element_size(),
        0 if lse is None else lse.data_ptr() + window.q_start * g.heads * 4,
        0 if key_lens is None else key_lens.data_ptr(),
    )
    scalars = {
        "heads": g.heads, "seq_q": g.q_count, "seq_k": g.k_count, "q_pitch": g.q_pitch, "kv_pitch": g.kv_pitch,
        "out_pitch": out.shape[1], "head_dim": g.head_dim, "scale": plan.scale, "scale_log2": g.scale_log2,
        "batch": g.planes // g.heads,
    }  # fmt: skip
    device_index = out.device.index
    if spec.operands == "tensor_maps":
        maps = [
            tensor_maps.map_at(tensor_maps.rows_of(t, start, stop), g.head_dim, g.dtype, box_rows)
            for t, start, stop, box_rows in (
                (plan.query, window.q_start, window.q_stop, variant.rows_per_block),
                (plan.key, window.k_start, window.k_stop, variant.key_rows),
                (plan.value, window.k_start, window.k_stop, variant.key_rows),
            )
        ]
        out_map, box = _out_map_at(plan)(pointers[3]), variant.key_rows
        bias = tensor_maps.unused_map() if plan.key_bias is None else tensor_maps.bias_map_at(plan.key_bias, box)
        operands, keep = (*_with_maps(maps, pointers[3:]), out_map[1], bias[1]), (maps, out_map, bias, plan.key_bias)
    else:
        split = plan.split if workspace is None else workspace
        operands, keep = _operands(spec, pointers, g, device_index, plan.prepass_function, split)
    return Launch(
        device_index,
        variant.grid(g.planes // g.heads, g.heads, g.q_count, nvrtc.multiprocessors(device_index)),
        variant.threads,
        variant.shared_bytes,
        _signature(spec),
        operands + tuple(scalars[name] for name in spec.scalars),
        keep,
    )


def launch_geometry(plan: AttentionPlan) -> tuple[Geometry, tuple[int, int, int]]:
    """The plan's `Geometry` (the window's rows, the inputs' pitches, dtype and heads) and the addresses of the
    window's first rows of q, k and v (0s for split planes)."""
    (batch, heads, seq_q, head_dim), kv_pitch, dtype, inputs = _inputs(plan)
    window = plan.window
    q_count, k_count = window.q_stop - window.q_start, window.k_stop - window.k_start
    geometry = Geometry(batch * heads, q_count, k_count, seq_q, kv_pitch, head_dim, dtype, heads, plan.scale * LOG2_E)
    return geometry, inputs


def _inputs(plan: AttentionPlan) -> tuple[tuple[int, ...], int, torch.dtype, tuple[int, int, int]]:
    """q's `[B, H, Nq, D]`, k's and v's rows, their dtype, and the addresses of the window's first rows of
    q, k and v (0s for split planes, whose operands come whole from `plan.split`)."""
    if plan.split is not None:
        return plan.split.shape, plan.split.seq, torch.float32, (0, 0, 0)
    query, key, value, window = plan.query, plan.key, plan.value, plan.window
    size = query.element_size()
    pointers = (
        query.data_ptr() + window.q_start * query.stride(2) * size,
        key.data_ptr() + window.k_start * key.stride(2) * size,
        value.data_ptr() + window.k_start * value.stride(2) * size,
    )
    return query.shape, key.shape[2], query.dtype, pointers


_SIGNATURES: dict[str, tuple[Any, ...]] = {}


def _signature(spec: KernelSpec) -> tuple[Any, ...]:
    """The ctypes kinds of a row's arguments: its operands (`_OPERAND_KINDS`), then its scalars."""
    signature = _SIGNATURES.get(spec.name)
    if signature is None:
        scalars = tuple(_SCALAR_TYPES[name] for name in spec.scalars)
        signature = _SIGNATURES[spec.name] = _OPERAND_KINDS[spec.operands] + scalars
    return signature


def _operands(
    spec: KernelSpec, pointers: tuple[int, ...], geometry: Geometry, device_index: int, prepass: int,
    split: SplitPlanes | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[Any, ...], object]:  # fmt: skip
    """(operand values, what must stay referenced until the launch) of a contiguous-input row's
    operand kind, from the window's (q, k, v, out, lse, key_lens) addresses; "split_planes" runs
    the split prepass first unless `split` holds the planes (and maxima) already, "quantized" the 8-bit one in the
    row's P.V scheme (`prepass`: its loaded `CUfunction` handle)."""
    if spec.operands == "pointers":
        return pointers, None
    if spec.operands == "quantized":
        return quantized_operands(pointers, geometry, device_index, prepass, spec.geometry["PV"])
    planes, colmax = split_planes(pointers[:3], geometry, device_index, prepass) if split is None else split[:2]
    maps = split_maps(planes.data_ptr(), geometry)
    keep = (maps, planes) if split is None else maps  # given planes stay referenced by the caller
    return (*_with_maps(maps, pointers[3:]), colmax.data_ptr()), keep


def on_workspace(built: Launch, planes: int, colmax: int, geometry: Geometry) -> Launch:
    """`built`, a split-planes kernel's launch (`_operands`' layout: the planes' three maps, out, lse, key counts,
    the column maxima, then scalars), reading a workspace whose planes and maxima are at other addresses."""
    maps = split_maps(planes, geometry)
    args = (*_with_maps(maps, built.args[OUT_OPERAND:SPLIT_COLMAX_OPERAND]), colmax)
    return built._replace(args=(*args, *built.args[SPLIT_COLMAX_OPERAND + 1 :]), keep=maps)


def split_maps(base: int, geometry: Geometry) -> list[tuple[ctypes.Array, int]]:
    """The maps of the split's q, k and v planes (`SplitPlanes.planes`' layout) in a workspace at `base`."""
    g, half = geometry, 2
    q_bytes = 2 * g.planes * g.q_count * g.head_dim * half
    k_bytes = 2 * g.planes * g.k_count * g.head_dim * half
    return [
        tensor_maps.map_at(_split_plane_rows(address, g.planes, count, g.head_dim), g.head_dim, torch.float16,
                           _SPLIT_BOX_ROWS)
        for address, count in ((base, g.q_count), (base + q_bytes, g.k_count), (base + q_bytes + k_bytes, g.k_count))
    ]  # fmt: skip


_MAP_KINDS = (None, None, None, _U64, _U64, _U64)
_OPERAND_KINDS = {
    "pointers": (_U64,) * 6, "tensor_maps": (*_MAP_KINDS, None, None), "split_planes": (*_MAP_KINDS, _U64),
    "quantized": (*_MAP_KINDS, _U64, _U64, _U64, _U64),
}  # fmt: skip


def _with_maps(maps: list[tuple[ctypes.Array, int]], pointers: tuple[int, ...]) -> tuple[int, ...]:
    """The three maps' addresses (passed by value: `runtime.launch` copies their bytes), then `pointers`."""
    return (*(address for _, address in maps), *pointers)


def _split_plane_rows(address: int, planes: int, rows: int, head_dim: int) -> tensor_maps.Planes:
    """The split's hi then lo planes of one tensor, `[2 * planes, rows, head_dim]` float16 at `address`,
    as `2 * planes` heads of one batch."""
    return tensor_maps.Planes(address, 2 * planes, rows, 1, rows * head_dim, head_dim, 2 * planes * rows * head_dim)


SPLIT_SIGNATURE = (_U64,) * 5 + (_U32,) * 5
"""The split kernel's arguments: q, k, v, planes, column maxima; counts, pitches and the phase."""
SPLIT_PLANES_ARG = 3
"""Where the split kernel's planes address is among its arguments (`split_args`)."""
SPLIT_COLMAX_OPERAND = 6
"""Where a split-planes kernel's column maxima address is among its operands (`_operands`)."""


@functools.cache
def _device(device_index: int) -> torch.device:
    return torch.device("cuda", device_index)


_SPLIT_BOX_ROWS = 64


def split_buffers(
    groups: int, q_rows: int, k_rows: int, head_dim: int, device_index: int, one_allocation: bool, zero: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split planes (float16, flat, `geometry.split_halves`) and column maxima (int32 `[3, groups, D]`, zeroed
    unless not `zero`) on the device: views of one allocation where `one_allocation` (a custom op's outputs may
    not alias)."""
    halves, device = split_halves(groups, q_rows, k_rows, head_dim), _device(device_index)
    if one_allocation:
        workspace = torch.empty(halves + 6 * groups * head_dim, dtype=torch.float16, device=device)
        planes, colmax = workspace[:halves], workspace[halves:].view(torch.int32).view(3, groups, head_dim)
    else:
        planes = torch.empty(halves, dtype=torch.float16, device=device)
        colmax = torch.empty((3, groups, head_dim), dtype=torch.int32, device=device)
    if zero:
        runtime.zero(colmax.data_ptr(), colmax.numel() * 4, device_index)
    return planes, colmax


def _two_phases(
    function: int, device_index: int, grid: tuple[int, int, int], threads: int, signature: tuple[Any, ...],
    args: tuple[Any, ...],
) -> None:  # fmt: skip
    """Launch a two-phase entry (the split's, the split prologue's): `args`, then phase 0 and phase 1."""
    for phase in (0, 1):
        runtime.launch(function, device_index, grid, threads, 0, signature, (*args, phase))


def split_args(
    pointers: tuple[int, int, int], planes: int, colmax: int, geometry: Geometry
) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The split kernel's grid and arguments but the phase (`SPLIT_SIGNATURE`), from the window's f32 q, k, v
    (first-row addresses, `geometry`) into planes and column maxima at the given addresses."""
    g = geometry
    grid = (g.planes, -(-max(g.q_count, g.k_count) // SPLIT.rows_per_block), 3)
    return grid, (*pointers, planes, colmax, g.q_count, g.k_count, g.q_pitch, g.kv_pitch)


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
    grid, args = split_args(pointers, planes.data_ptr(), colmax.data_ptr(), g)
    _two_phases(function, device_index, grid, SPLIT.threads, SPLIT_SIGNATURE, args)
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


_PROLOGUE_SIGNATURE = (_U64,) * 15 + (_U64,) * 4 + (_U32,) * 5 + (_F32, _F32, ctypes.c_int32)


def qkv_prologue_cuda(
    layout: PrologueLayout, out_dtype: torch.dtype = torch.float32, gap_at: int = 0, kv_gap: int = 0,
    one_allocation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run `qkv_prologue` on projections `prologue_layout.prologue_layout` accepted.

    Returns q, k, v: new contiguous tensors in `out_dtype` (float32, bfloat16 or
    float16), q `[B, H, N, D]`, k and v `[B, H, N + kv_gap, D]` whose rows from token
    `gap_at` on sit `kv_gap` rows down (rows [gap_at, gap_at + kv_gap) are left unwritten).
    `one_allocation` (eager calls without a gap; a custom op's outputs may not alias): q, k and v
    are the three planes of one `[3, B, H, N, D]` allocation.
    """
    shape = (layout.batch, layout.heads, layout.seq, layout.head_dim)
    device = _device(layout.device_index)
    if one_allocation and kv_gap == 0:
        outs = torch.empty((3, *shape), dtype=out_dtype, device=device).unbind(0)
    else:
        kv_shape = (layout.batch, layout.heads, layout.seq + kv_gap, layout.head_dim)
        outs = [torch.empty(s, dtype=out_dtype, device=device) for s in (shape, kv_shape, kv_shape)]
    variant = prologue_variant(layout.head_dim, DTYPE_NAMES[layout.dtype], DTYPE_NAMES[out_dtype])
    extents = [layout.text_len, layout.seq, layout.heads, gap_at, kv_gap]
    scalars = [*layout.strides, *extents, *layout.eps, int(layout.rope)]
    runtime.launch(
        nvrtc.function(variant, layout.device_index),
        layout.device_index,
        (layout.seq, layout.batch, 1),
        variant.threads,
        0,
        _PROLOGUE_SIGNATURE,
        [*layout.pointers, *(t.data_ptr() for t in outs), *scalars],
    )
    return tuple(outs)


_PROLOGUE_SPLIT_SIGNATURE = (_U64,) * 14 + (_U64,) * 4 + (_U32,) * 3 + (_F32, _F32, ctypes.c_int32, _U32)


def qkv_prologue_split_cuda(layout: PrologueLayout, one_allocation: bool = False) -> SplitPlanes:
    """Run `qkv_prologue_split` (its two phases) on projections `prologue_layout.prologue_layout` accepted,
    head_dim 128: the f32 q, k, v `qkv_prologue_cuda` writes, as the planes and column maxima the split
    kernel makes of them (`split_qkv_cuda`), bit for bit, with no f32 q, k, v in between. `one_allocation`
    (eager calls): planes and maxima are views of one allocation."""
    groups, seq = layout.batch * layout.heads, layout.seq
    planes, colmax = split_buffers(groups, seq, seq, layout.head_dim, layout.device_index, one_allocation)
    variant = prologue_split_variant(layout.head_dim, DTYPE_NAMES[layout.dtype])
    grid = (groups, -(-seq // variant.rows_per_block), 3)
    outs = (planes.data_ptr(), colmax.data_ptr())
    args = (*layout.pointers, *outs, *layout.strides, layout.text_len, seq, layout.heads, *layout.eps, int(layout.rope))
    function = nvrtc.function(variant, layout.device_index)
    _two_phases(function, layout.device_index, grid, variant.threads, _PROLOGUE_SPLIT_SIGNATURE, args)
    return SplitPlanes(planes, colmax, layout.heads, seq)
