"""One attention call on CUDA, resolved once into an immutable plan that `launch.run` executes.

`plan_attention` takes validated CUDA inputs and decides everything a launch needs, in one place: the
kernel (`resolve`: the memoised `selection.select_kernel` for this device, each chosen kernel built and
loaded; "auto" moves past one that cannot be), the operands as that kernel reads them (in place through
TMA, contiguous copies, or float32 upcasts), the row window and the output it writes.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import torch

from ..dtypes import DTYPE_NAMES, DTYPES
from . import runtime, tensor_maps
from .geometry import Window, full_window
from .registry import Variant, quantize_variant
from .selection import NoKernelError, Problem, Selection, select_kernel


class AttentionPlan(NamedTuple):
    """One resolved attention call.

    `selection`: the kernel variant (None: SDPA runs it). `query`, `key`, `value`: `[B, H, N, D]` as the
    kernel reads them. `written`: what the kernel writes, `[B, Nq, H*D]` in its output dtype. `out`: the
    caller's destination (None: a new tensor), `out_dtype` its dtype. `lse`: `[B, Nq, H]` float32 or None;
    `key_lens`: int32 `[B]` or None; `window`: the rows computed; `scale`: the logit scale.
    """

    selection: Selection
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    written: torch.Tensor | None
    out: torch.Tensor | None
    out_dtype: torch.dtype
    lse: torch.Tensor | None
    key_lens: torch.Tensor | None
    window: Window
    scale: float


def plan_attention(
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
) -> AttentionPlan:
    """The plan for validated CUDA inputs.

    Args:
        query: `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]` (one dtype, any strides: kernels that
            read through tensor maps take them in place when TMA can, e.g. token-major views; the
            others get contiguous copies).
        kernel: "auto" or a registry name of the inputs' family.
        out: the destination, contiguous `[B, Nq, H*D]` `out_dtype`, 16-byte aligned; required with a window.
        lse: if given, `[B, Nq, H]` float32 contiguous: receives each computed row's natural
            log-sum-exp of its scaled logits.
        window: compute only query rows [q_start, q_stop) over keys [k_start, k_stop) (the
            rest of `out` and `lse` is left as it is); default: all rows over all keys.
        key_lens: if given, `[B]` int32 contiguous: batch b attends the first `key_lens[b]` keys of
            the window (clamped to [0, window keys]); a batch with none gets rows of 0 and LSE -inf.
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
    shape = (batch, seq_q, heads * head_dim)
    out = None if out is None else output(out, shape, out_dtype, query.device)
    variant, written = selection.variant, None
    if variant is not None:
        if selection.upcast:
            query, key, value = (
                t.to(torch.float32, memory_format=torch.contiguous_format) for t in (query, key, value)
            )
        elif variant.spec.operands != "tensor_maps":
            query, key, value = (t.contiguous() for t in (query, key, value))
        kernel_dtype = DTYPES[variant.out_dtype]
        written = (
            out
            if kernel_dtype == out_dtype and out is not None
            else torch.empty(shape, dtype=kernel_dtype, device=query.device)
        )
    return AttentionPlan(selection, query, key, value, written, out, out_dtype, lse, key_lens, window, scale)


def _in_place_or_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if contiguous or readable by TMA in place (the tensor-map kernels), else a contiguous copy."""
    return tensor if tensor.is_contiguous() or tensor_maps.readable(tensor) else tensor.contiguous()


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


def cannot_run(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> str | None:  # fmt: skip
    """Why `kernel` cannot run these CUDA inputs on their device (None if it can)."""
    aligned = not (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16
    try:
        resolve(kernel, query.dtype, out_dtype or query.dtype, query.shape[-1], query.device.index, aligned)
    except NoKernelError as error:
        return str(error)
    return None
