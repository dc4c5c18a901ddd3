"""The one launch path: resolve a kernel for CUDA inputs, allocate the output, launch.

`attention_cuda` serves every attention kernel of the registry and
`qkv_prologue_cuda` the prologue; both build the kernel's argument list from
its registry row and hand it to `runtime.launch`. Inputs were validated at
the public boundary (`ops.attention`); nothing here re-checks them.
"""

from __future__ import annotations

import ctypes
import math
import threading
import warnings
from typing import Any

import torch

from . import runtime, tensor_maps
from .registry import NoKernelError, Problem, Selection, Variant, prologue_variant, select_kernel, split_variant
from .validation import PrologueLayout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_LOG2_E = 1.0 / math.log(2.0)
_U32, _U64, _F32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_SCALAR_TYPES = {"heads": _U32, "seq": _U32, "head_dim": _U32, "scale": _F32, "scale_log2": _F32}

_resolved: dict[tuple[Any, ...], Selection] = {}
_disabled: dict[int, dict[str, str]] = {}
_lock = threading.Lock()


def resolve(kernel: str, in_dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, device_index: int,
            aligned: bool) -> Selection:  # fmt: skip
    """The selection for these inputs on this device, memoised; "auto" skips (and warns once
    about) a kernel that cannot be built or loaded here."""
    key = (kernel, in_dtype, out_dtype, head_dim, device_index, aligned)
    selection = _resolved.get(key)
    if selection is not None:
        return selection
    capability, shared_limit = runtime.device_facts(device_index)
    problem = Problem(DTYPE_NAMES[in_dtype], DTYPE_NAMES[out_dtype], head_dim, capability, shared_limit, aligned)
    with _lock:
        disabled = _disabled.setdefault(device_index, {})
        while True:
            selection = select_kernel(problem, kernel, disabled)
            problem_text = _prepare(selection.variant, device_index)
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
        if variant.spec.operands == "tensor_maps":
            tensor_maps.check_driver()
        runtime.function(variant, device_index)
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
) -> torch.Tensor:
    """Attention of validated CUDA inputs `[B, H, N, D]`, token-major `[B, N, H*D]` in `out_dtype`.

    `kernel` is "auto" or a registry name of the inputs' family; `out`, if given,
    is the destination (contiguous, 16-byte aligned, `out_dtype`).
    """
    batch, heads, seq, head_dim = query.shape
    aligned = not (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16
    selection = resolve(kernel, query.dtype, out_dtype, head_dim, query.device.index, aligned)
    if selection.upcast:
        query, key, value = query.float(), key.float(), value.float()
    variant = selection.variant
    written = DTYPES[variant.out_dtype]
    shape = (batch, seq, heads * head_dim)
    result = output(out if written == out_dtype else None, shape, written, query.device)
    launch_attention(variant, query, key, value, result, scale)
    if written == out_dtype:
        return result
    if out is None:
        return result.to(out_dtype)
    return output(out, shape, out_dtype, query.device).copy_(result)


def launch_attention(
    variant: Variant, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, scale: float
) -> None:
    """Launch an attention `variant` on inputs and an output it accepts (see `registry.blocker`)."""
    spec = variant.spec
    batch, heads, seq, head_dim = query.shape
    scalars = {"heads": heads, "seq": seq, "head_dim": head_dim, "scale": scale, "scale_log2": scale * _LOG2_E}
    operands, kinds, _keep = _operands(spec.operands, query, key, value, out)
    runtime.launch(
        runtime.function(variant, query.device.index),
        query.device.index,
        variant.grid(batch, heads, seq),
        spec.threads,
        spec.shared_bytes(head_dim),
        kinds + tuple(_SCALAR_TYPES[name] for name in spec.scalars),
        operands + tuple(scalars[name] for name in spec.scalars),
    )


def _operands(
    kind: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor
) -> tuple[tuple[Any, ...], tuple[Any, ...], object]:
    """(operand values, their ctypes kinds, what must stay referenced until the launch) of a row's
    operand kind; "split_planes" runs the split prepass first."""
    if kind == "pointers":
        return (query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr()), (_U64,) * 4, None
    if kind == "tensor_maps":
        maps = [tensor_maps.tensor_map(t) for t in (query, key, value)]
        return (*(address for _, address in maps), out.data_ptr()), (None, None, None, _U64), maps
    planes, colmax = split_planes(query, key, value)
    batch, heads, seq, head_dim = query.shape
    shape, plane_bytes = (2, batch * heads, seq, head_dim), 2 * batch * heads * seq * head_dim * 2
    pointer = planes.data_ptr()
    maps = [tensor_maps.map_at(pointer + t * plane_bytes, shape, torch.float16, _SPLIT_BOX_ROWS) for t in range(3)]
    operands = (*(address for _, address in maps), out.data_ptr(), colmax.data_ptr())
    return operands, (None, None, None, _U64, _U64), (maps, planes, colmax)


_SPLIT_SIGNATURE = (_U64,) * 5 + (_U32, _U32)
_SPLIT_BOX_ROWS = 64


def split_planes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 q, k, v `[B, H, N, 128]` as scaled float16 hi/lo planes, by the split kernel's two phases.

    Returns planes `[3 (q, k, v), 2 (hi, lo), B*H, N, 128]` float16 and the column maxima
    `[3, B*H, 128]` (f32 bit patterns as int32) that give each group's scale.
    """
    batch, heads, seq, head_dim = query.shape
    groups, device = batch * heads, query.device
    planes = torch.empty((3, 2, groups, seq, head_dim), dtype=torch.float16, device=device)
    colmax = torch.zeros((3, groups, head_dim), dtype=torch.int32, device=device)
    variant = split_variant(head_dim)
    function = runtime.function(variant, device.index)
    grid = (groups, -(-seq // variant.spec.rows_per_block), 3)
    pointers = (query.data_ptr(), key.data_ptr(), value.data_ptr(), planes.data_ptr(), colmax.data_ptr())
    for phase in (0, 1):
        runtime.launch(function, device.index, grid, variant.spec.threads, 0, _SPLIT_SIGNATURE, (*pointers, seq, phase))
    return planes, colmax


_PROLOGUE_SIGNATURE = (_U64,) * 15 + (_U64,) * 4 + (_U32,) * 3 + (_F32, _F32, ctypes.c_int32)


def qkv_prologue_cuda(
    layout: PrologueLayout, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run `qkv_prologue` on projections `validation.prologue_layout` accepted.

    Returns q, k, v: new contiguous `[B, H, N, D]` tensors in `out_dtype`
    (float32, bfloat16 or float16).
    """
    shape = (layout.batch, layout.heads, layout.seq, layout.head_dim)
    device = torch.device("cuda", layout.device_index)
    outs = [torch.empty(shape, dtype=out_dtype, device=device) for _ in range(3)]
    variant = prologue_variant(layout.head_dim, DTYPE_NAMES[layout.dtype], DTYPE_NAMES[out_dtype])
    scalars = [*layout.strides, layout.text_len, layout.seq, layout.heads, *layout.eps, int(layout.rope)]
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
