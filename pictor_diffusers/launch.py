"""The one launch path: resolve a kernel for CUDA inputs, allocate the output, launch.

`attention_cuda` serves every attention kernel of the registry and
`qkv_prologue_cuda` the prologue; both build the kernel's argument list from
its registry row and hand it to `runtime.launch`. Inputs were validated at
the public boundary (`ops.attention`); nothing here re-checks them.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
import warnings
from typing import Any

import torch

from . import runtime, tensor_maps
from .dtypes import DTYPE_NAMES, DTYPES
from .geometry import Geometry, Window, full_window
from .quantized import quantized_operands
from .registry import KernelSpec, Variant, prologue_variant, quantize_variant, split_variant
from .selection import NoKernelError, Problem, Selection, select_kernel
from .validation import PrologueLayout

_LOG2_E = 1.0 / math.log(2.0)
_U32, _U64, _F32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_SCALAR_TYPES = {
    "heads": _U32, "seq_q": _U32, "seq_k": _U32, "q_pitch": _U32, "kv_pitch": _U32, "out_pitch": _U32,
    "head_dim": _U32, "scale": _F32, "scale_log2": _F32,
}  # fmt: skip

_resolved: dict[tuple[Any, ...], Selection] = {}
_disabled: dict[int, dict[str, str]] = {}
_lock = threading.Lock()


def resolve(kernel: str, in_dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, device_index: int,
            aligned: bool, key_lens: bool = False, lse: bool = False) -> Selection:  # fmt: skip
    """The selection for these inputs on this device (`key_lens`: with per-batch key counts; `lse`: with
    the log-sum-exp), memoised; "auto" skips (and warns once about) a kernel that cannot be built or
    loaded here."""
    key = (kernel, in_dtype, out_dtype, head_dim, device_index, aligned, key_lens, lse)
    selection = _resolved.get(key)
    if selection is not None:
        return selection
    capability, shared_limit = runtime.device_facts(device_index)
    problem = Problem(
        DTYPE_NAMES[in_dtype], DTYPE_NAMES[out_dtype], head_dim, capability, shared_limit, aligned, key_lens, lse
    )
    with _lock:
        disabled = _disabled.setdefault(device_index, {})
        while True:
            selection = select_kernel(problem, kernel, disabled)
            problem_text = None if selection.variant is None else _prepare(selection.variant, device_index)
            if problem_text is None:
                break
            if kernel != "auto":
                raise NoKernelError(f"kernel={kernel!r} cannot run here: {problem_text}")
            disabled[selection.variant.spec.name] = problem_text
            warnings.warn(f"pictor-diffusers: {problem_text}; using the next kernel", RuntimeWarning, stacklevel=4)
        _resolved[key] = selection
    return selection


def _prepare(variant: Variant, device_index: int) -> str | None:
    """Compile and load `variant` (and the driver's tensor maps where it uses them), or say why not."""
    try:
        if variant.spec.operands in ("tensor_maps", "quantized"):
            tensor_maps.check_driver()
        runtime.function(variant, device_index)
        if variant.spec.operands == "quantized":
            runtime.function(quantize_variant(variant.head_dim, variant.in_dtype), device_index)
    except ImportError:
        raise
    except Exception as error:  # a build or load failure disables the kernel with its reason
        return f"the {variant.spec.name} kernel could not be prepared ({type(error).__name__}: {error})"
    return None


def output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out` checked against the destination a kernel writes, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} {shape} tensor on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.data_ptr() % 16:
        raise ValueError(f"out must be 16-byte aligned, got address {out.data_ptr():#x} (a view with an offset?)")
    return out


def attention_cuda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    kernel: str,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window: Window | None = None,
    key_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of validated CUDA inputs, token-major `[B, Nq, H*D]` in `out_dtype`.

    Args:
        query: `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]` (one dtype, any strides: kernels that
            read through tensor maps take them in place when TMA can, e.g. token-major views; the
            others get contiguous copies).
        kernel: "auto" or a registry name of the inputs' family.
        out: the destination, contiguous `[B, Nq, H*D]` `out_dtype`, 16-byte aligned;
            required with a window.
        lse: if given, `[B, Nq, H]` float32 contiguous: receives each computed row's natural
            log-sum-exp of its scaled logits.
        window: compute only query rows [q_start, q_stop) over keys [k_start, k_stop) (the
            rest of `out` and `lse` is left as it is); default: all rows over all keys.
        key_lens: if given, `[B]` int32 contiguous: batch b attends the first `key_lens[b]` keys of
            the window (clamped to [0, window keys]); a batch with none gets rows of 0 and LSE -inf (as torch's SDPA).
    """
    batch, heads, seq_q, head_dim = query.shape
    window = full_window(query, key) if window is None else window
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        query, key, value = _in_place_or_copy(query), _in_place_or_copy(key), _in_place_or_copy(value)
    size = query.element_size()
    q_at = query.data_ptr() + window.q_start * query.stride(2) * size
    k_at = key.data_ptr() + window.k_start * key.stride(2) * size
    aligned = not (q_at | k_at | value.data_ptr() + window.k_start * value.stride(2) * size) % 16
    selection = resolve(
        kernel, query.dtype, out_dtype, head_dim, query.device.index, aligned, key_lens is not None, lse is not None
    )
    variant = selection.variant
    if variant is None:
        return _sdpa_attention(query, key, value, scale, out, window)
    if selection.upcast:
        query, key, value = (t.to(torch.float32, memory_format=torch.contiguous_format) for t in (query, key, value))
    elif variant.spec.operands != "tensor_maps":
        query, key, value = (t.contiguous() for t in (query, key, value))
    written = DTYPES[variant.out_dtype]
    shape = (batch, seq_q, heads * head_dim)
    result = output(out if written == out_dtype else None, shape, written, query.device)
    launch_attention(variant, query, key, value, result, lse, scale, window, key_lens)
    if written == out_dtype:
        return result
    if out is None:
        return result.to(out_dtype)
    rows = slice(window.q_start, window.q_stop)
    output(out, shape, out_dtype, query.device)[:, rows].copy_(result[:, rows])
    return out


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
    output(out, (batch, query.shape[2], heads * head_dim), query.dtype, query.device)[:, rows].copy_(token_major)
    return out


def _in_place_or_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if contiguous or readable by TMA in place (the tensor-map kernels), else a contiguous copy."""
    return tensor if tensor.is_contiguous() or tensor_maps.readable(tensor) else tensor.contiguous()


def launch_attention(
    variant: Variant,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scale: float,
    window: Window,
    key_lens: torch.Tensor | None = None,
) -> None:
    """Launch an attention `variant` on inputs and an output it accepts (see `selection.blocker`),
    for the rows of `window` (and `key_lens` keys of each batch, if given)."""
    spec = variant.spec
    batch, heads, seq_q, head_dim = query.shape
    q_count, k_count = window.q_stop - window.q_start, window.k_stop - window.k_start
    size = query.element_size()
    pointers = (
        query.data_ptr() + window.q_start * query.stride(2) * size,
        key.data_ptr() + window.k_start * key.stride(2) * size,
        value.data_ptr() + window.k_start * value.stride(2) * size,
        out.data_ptr() + window.q_start * heads * head_dim * out.element_size(),
        0 if lse is None else lse.data_ptr() + window.q_start * heads * 4,
        0 if key_lens is None else key_lens.data_ptr(),
    )
    scalars = {
        "heads": heads, "seq_q": q_count, "seq_k": k_count, "q_pitch": seq_q, "kv_pitch": key.shape[2],
        "out_pitch": out.shape[1], "head_dim": head_dim, "scale": scale, "scale_log2": scale * _LOG2_E,
    }  # fmt: skip
    if spec.operands == "tensor_maps":
        maps = [
            tensor_maps.map_at(tensor_maps.rows_of(query, window.q_start, window.q_stop), head_dim, query.dtype),
            tensor_maps.map_at(tensor_maps.rows_of(key, window.k_start, window.k_stop), head_dim, query.dtype),
            tensor_maps.map_at(tensor_maps.rows_of(value, window.k_start, window.k_stop), head_dim, query.dtype),
        ]
        operands, _keep = _with_maps(maps, pointers[3:]), maps
    else:
        geometry = Geometry(
            batch * heads, q_count, k_count, seq_q, key.shape[2], head_dim, query.dtype, heads, scalars["scale_log2"]
        )
        operands, _keep = _operands(spec.operands, pointers, geometry, query.device.index)
    runtime.launch(
        runtime.function(variant, query.device.index),
        query.device.index,
        variant.grid(batch, heads, q_count),
        spec.threads,
        spec.shared_bytes(head_dim),
        _signature(spec),
        operands + tuple(scalars[name] for name in spec.scalars),
    )


_SIGNATURES: dict[str, tuple[Any, ...]] = {}


def _signature(spec: KernelSpec) -> tuple[Any, ...]:
    """The ctypes kinds of a row's arguments: its operands (`_OPERAND_KINDS`), then its scalars."""
    signature = _SIGNATURES.get(spec.name)
    if signature is None:
        scalars = tuple(_SCALAR_TYPES[name] for name in spec.scalars)
        signature = _SIGNATURES[spec.name] = _OPERAND_KINDS[spec.operands] + scalars
    return signature


def _operands(
    kind: str, pointers: tuple[int, ...], geometry: Geometry, device_index: int
) -> tuple[tuple[Any, ...], object]:
    """(operand values, what must stay referenced until the launch) of a contiguous-input row's
    operand kind, from the window's (q, k, v, out, lse, key_lens) addresses; "split_planes" runs
    the split prepass first, "quantized" the 8-bit one."""
    if kind == "pointers":
        return pointers, None
    if kind == "quantized":
        return quantized_operands(pointers, geometry, device_index)
    g = geometry
    planes, colmax = split_planes(pointers[:3], geometry, device_index)
    base, half = planes.data_ptr(), 2
    q_bytes = 2 * g.planes * g.q_count * g.head_dim * half
    k_bytes = 2 * g.planes * g.k_count * g.head_dim * half
    maps = [
        tensor_maps.map_at(_split_plane_rows(address, g.planes, count, g.head_dim), g.head_dim, torch.float16,
                           _SPLIT_BOX_ROWS)
        for address, count in ((base, g.q_count), (base + q_bytes, g.k_count), (base + q_bytes + k_bytes, g.k_count))
    ]  # fmt: skip
    return (*_with_maps(maps, pointers[3:]), colmax.data_ptr()), (maps, planes)


_MAP_KINDS = (None, None, None, _U64, _U64, _U64)
_OPERAND_KINDS = {
    "pointers": (_U64,) * 6, "tensor_maps": _MAP_KINDS, "split_planes": (*_MAP_KINDS, _U64),
    "quantized": (*_MAP_KINDS, _U64, _U64, _U64, _U64),
}  # fmt: skip


def _with_maps(maps: list[tuple[ctypes.Array, int]], pointers: tuple[int, ...]) -> tuple[int, ...]:
    """The three maps' addresses (passed by value: `runtime.launch` copies their bytes), then `pointers`."""
    return (*(address for _, address in maps), *pointers)


def _split_plane_rows(address: int, planes: int, rows: int, head_dim: int) -> tensor_maps.Planes:
    """The split's hi then lo planes of one tensor, `[2 * planes, rows, head_dim]` float16 at `address`,
    as `2 * planes` heads of one batch."""
    return tensor_maps.Planes(address, 2 * planes, rows, 1, rows * head_dim, head_dim, 2 * planes * rows * head_dim)


_SPLIT_SIGNATURE = (_U64,) * 5 + (_U32,) * 5


@functools.cache
def _device(device_index: int) -> torch.device:
    return torch.device("cuda", device_index)


_SPLIT_BOX_ROWS = 64


def split_planes(
    pointers: tuple[int, int, int], geometry: Geometry, device_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's f32 q, k, v (first-row addresses, `geometry`) as scaled float16 hi/lo planes,
    by the split kernel's two phases.

    Returns the planes (float16, flat: q's `[2 (hi, lo), planes, q_count, D]`, then k's and v's,
    each `[2, planes, k_count, D]`) and the column maxima `[3, planes, D]` (f32 bit patterns as
    int32) that give each group's scale, both views of one allocation.
    """
    g = geometry
    plane_halves = 2 * g.planes * (g.q_count + 2 * g.k_count) * g.head_dim
    workspace = torch.empty(plane_halves + 6 * g.planes * g.head_dim, dtype=torch.float16, device=_device(device_index))
    planes, colmax = workspace[:plane_halves], workspace[plane_halves:].view(torch.int32).view(3, g.planes, g.head_dim)
    runtime.zero(colmax.data_ptr(), colmax.numel() * 4, device_index)
    variant = split_variant(g.head_dim)
    function = runtime.function(variant, device_index)
    grid = (g.planes, -(-max(g.q_count, g.k_count) // variant.spec.rows_per_block), 3)
    args = (*pointers, planes.data_ptr(), colmax.data_ptr(), g.q_count, g.k_count, g.q_pitch, g.kv_pitch)
    for phase in (0, 1):
        runtime.launch(function, device_index, grid, variant.spec.threads, 0, _SPLIT_SIGNATURE, (*args, phase))
    return planes, colmax


_PROLOGUE_SIGNATURE = (_U64,) * 15 + (_U64,) * 4 + (_U32,) * 5 + (_F32, _F32, ctypes.c_int32)


def qkv_prologue_cuda(
    layout: PrologueLayout, out_dtype: torch.dtype = torch.float32, gap_at: int = 0, kv_gap: int = 0,
    one_allocation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Run `qkv_prologue` on projections `validation.prologue_layout` accepted.

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
        runtime.function(variant, layout.device_index),
        layout.device_index,
        (layout.seq, layout.batch, 1),
        variant.spec.threads,
        0,
        _PROLOGUE_SIGNATURE,
        [*layout.pointers, *(t.data_ptr() for t in outs), *scalars],
    )
    return tuple(outs)


def cannot_run(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> str | None:  # fmt: skip
    """Why `kernel` cannot run these CUDA inputs on their device (None if it can)."""
    aligned = not (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16
    try:
        resolve(kernel, query.dtype, out_dtype or query.dtype, query.shape[-1], query.device.index, aligned)
    except NoKernelError as error:
        return str(error)
    return None
