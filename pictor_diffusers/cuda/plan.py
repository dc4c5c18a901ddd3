"""One attention call resolved once: the kernel-choice check, the kernel's selection, and the plan that
`launch.run` executes.

* `check_kernel_choice` says whether a `kernel=` name fits the inputs' dtypes (at the public boundary, for
  CPU and CUDA calls alike).
* `plan_attention` takes validated CUDA inputs and decides everything a launch needs, in one place: the
  kernel (`resolve`: the selection for this device, memoised, with the chosen build and the prepass its
  operands need loaded; "auto" moves past a kernel that cannot be), the operands as that kernel reads
  them (in place through TMA, contiguous copies, or float32 upcasts), the row window and the output.
* `plan_split_attention` plans the same for q, k, v the split prologue already turned into the fp16x3
  kernel's planes (no prepass runs), where `selects_split_planes` says the kernel reads them.
* `cannot_run` says why a named kernel cannot run given CUDA inputs. Which kernel runs a problem is
  `selection.select_kernel`'s answer, from plain facts.

`registry.py` answers table lookups and `nvrtc.function` builds and loads; neither calls back here.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import torch

from ..dtypes import COMPUTE_DTYPES, DTYPE_NAMES, DTYPES
from . import nvrtc, runtime, tensor_maps
from .geometry import LOG2_E, SplitPlanes, Window, full_window
from .pass_rows import prepass_for
from .registry import (
    KERNEL_CHOICES,
    SHORT_KEYS,
    Variant,
    kernels_for,
)
from .selection import NoKernelError, Problem, Selection, select_kernel

_VALID_CHOICES = {
    (kernel, in_dtype, out_dtype)
    for in_dtype, name in DTYPE_NAMES.items()
    for kernel in kernels_for(name)
    for out_dtype in (COMPUTE_DTYPES if in_dtype == torch.float32 else (in_dtype,))
}


def check_kernel_choice(kernel: str, in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Raise ValueError unless `kernel` takes `in_dtype` inputs and can write `out_dtype`.

    f32 inputs: "auto" or an fp32-family kernel of the registry, any of the three out dtypes.
    bf16/fp16 inputs: "auto", a 16-bit-family kernel or an 8-bit one ("fp8"), out dtype = input dtype.
    """
    if (kernel, in_dtype, out_dtype) in _VALID_CHOICES:
        return
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if out_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"out_dtype must be one of {COMPUTE_DTYPES}, got {out_dtype}")
    family = kernels_for(DTYPE_NAMES[in_dtype])
    if kernel not in family:
        raise ValueError(f"kernel={kernel!r} does not take {in_dtype} inputs; choose one of {family}")
    if in_dtype != torch.float32 and out_dtype != in_dtype:
        raise ValueError(f"the 16-bit kernels write their input dtype {in_dtype}, got out_dtype={out_dtype}")


class AttentionPlan(NamedTuple):
    """One resolved attention call.

    `selection`: the kernel variant (None: SDPA runs it); `function`: its loaded `CUfunction` handle, and
    `prepass_function` that of the prepass that makes its operands (0 where there is none). `query`, `key`,
    `value`: `[B, H, N, D]` as the kernel reads them. `written`: what the kernel writes, `[B, Nq, H*D]` in its
    output dtype. `out`: the caller's destination (None: a new tensor), `out_dtype` its dtype. `lse`:
    `[B, Nq, H]` float32 or None; `key_lens`: int32 `[B]` or None; `window`: the rows computed; `scale`: the
    logit scale; `launch`: the kernel's launch with its arguments already filled (`plan_memo`'s replays), or None;
    `split`: q, k, v already split (`plan_split_attention`; `query`, `key`, `value` are then None); `key_bias`:
    the window's key bias as the kernel reads it (`log2_key_bias`), or None.
    """

    selection: Selection
    function: int
    prepass_function: int
    query: torch.Tensor | None
    key: torch.Tensor | None
    value: torch.Tensor | None
    written: torch.Tensor | None
    out: torch.Tensor | None
    out_dtype: torch.dtype
    lse: torch.Tensor | None
    key_lens: torch.Tensor | None
    window: Window
    scale: float
    launch: runtime.Replayable | None = None
    split: SplitPlanes | None = None
    key_bias: torch.Tensor | None = None


class Prepared(NamedTuple):
    """A selection made runnable on one device: `function` is the chosen build's loaded `CUfunction` handle
    and `prepass_function` that of the prepass its operands need (`pass_rows.prepass_for`); 0 where there is
    none (SDPA, or a kernel that reads q, k, v as they are)."""

    selection: Selection
    function: int = 0
    prepass_function: int = 0


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
    key_bias: torch.Tensor | None = None,
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
        key_bias: if given, `[B, 1 or H, Nk]` float (checked): added to the scaled logits of every query row;
            only kernels with key-bias builds take it (`selection.blocker` says which); q, k, v whose rows
            are not 16-byte aligned are then copied.
    """
    batch, heads, seq_q, head_dim = query.shape
    window = full_window(query, key) if window is None else window
    if not (query.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        query, key, value = _in_place_or_copy(query), _in_place_or_copy(key), _in_place_or_copy(value)
    aligned = _window_aligned(query, key, value, window)
    if key_bias is not None and not aligned:  # only the wgmma builds take a bias, reading aligned rows
        query, key, value = (t.clone(memory_format=torch.contiguous_format) for t in (query, key, value))
        aligned = _window_aligned(query, key, value, window)
    short_keys = window.k_stop - window.k_start <= SHORT_KEYS
    selection, function, prepass_function = resolve(
        kernel,
        query.dtype,
        out_dtype,
        head_dim,
        query.device.index,
        aligned,
        key_lens is not None,
        lse is not None,
        short_keys,
        key_bias is not None,
    )
    shape = (batch, seq_q, heads * head_dim)
    out = None if out is None else _checked_out(out, shape, out_dtype, query.device)
    variant, written = selection.variant, None
    if variant is not None:
        if selection.upcast:
            query, key, value = (
                t.to(torch.float32, memory_format=torch.contiguous_format) for t in (query, key, value)
            )
        elif variant.spec.operands != "tensor_maps":
            query, key, value = (t.contiguous() for t in (query, key, value))
        written = _written(variant, shape, out, out_dtype, query.device)
        if key_bias is not None:
            key_bias = log2_key_bias(key_bias, heads, window, variant.key_rows)
    return AttentionPlan(
        selection, function, prepass_function, query, key, value, written, out, out_dtype, lse, key_lens, window,
        scale, key_bias=key_bias,
    )  # fmt: skip


_F32_MAX = torch.finfo(torch.float32).max


def _window_aligned(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: Window) -> bool:
    """Whether the window's first rows of q, k and v start on 16-byte boundaries."""
    size = query.element_size()
    q_at = query.data_ptr() + window.q_start * query.stride(2) * size
    k_at = key.data_ptr() + window.k_start * key.stride(2) * size
    return not (q_at | k_at | value.data_ptr() + window.k_start * value.stride(2) * size) % 16


def log2_key_bias(key_bias: torch.Tensor, heads: int, window: Window, key_rows: int) -> torch.Tensor:
    """`key_bias` `[B, 1 or H, Nk]` as the key-bias builds read it (kernels/key_bias.cuh): float32
    `[B * H, k_pad]`, the window's keys times log2(e), zero past them, k_pad = `key_rows` * ceil(window keys /
    `key_rows`); no host sync. Finite values stay finite (clamped to +-FLT_MAX: a row masked by finfo.min weighs
    its keys alike, as in SDPA, though its LSE saturates at -FLT_MAX ln 2), infinities stay infinite (-inf drops
    the key)."""
    batch, keys = key_bias.shape[0], window.k_stop - window.k_start
    bias = key_bias[:, :, window.k_start : window.k_stop].float()
    padded = torch.empty((batch, heads, -(-keys // key_rows) * key_rows), dtype=torch.float32, device=key_bias.device)
    logits = padded[:, :, :keys]
    bias = bias.expand(batch, heads, keys)
    torch.mul(bias, LOG2_E, out=logits)
    torch.where(bias.isinf(), bias, logits.clamp_(-_F32_MAX, _F32_MAX), out=logits)
    padded[:, :, keys:] = 0.0
    return padded.view(batch * heads, -1)


def plan_split_attention(split: SplitPlanes, scale: float, kernel: str, out_dtype: torch.dtype) -> AttentionPlan:
    """The plan for q, k, v the split prologue made (`split`, CUDA): every row over every key, by the kernel
    `kernel` selects for float32 inputs of their head_dim there, which reads the planes as they are (its
    split prepass does not run), into a new `[B, N, H*D]` `out_dtype` output. ValueError where that kernel
    does not read split planes (the caller routes by `selects_split_planes`)."""
    batch, heads, seq, head_dim = split.shape
    device = split.planes.device
    prepared = resolve(kernel, torch.float32, out_dtype, head_dim, device.index, aligned=True)
    variant = prepared.selection.variant
    if variant is None or variant.spec.operands != "split_planes":
        chosen = "SDPA" if variant is None else variant.spec.name
        raise ValueError(f"kernel={kernel!r} runs {chosen} here, which does not read split planes")
    written = _written(variant, (batch, seq, heads * head_dim), None, out_dtype, device)
    window = Window(0, seq, 0, seq)
    return AttentionPlan(
        prepared.selection, prepared.function, 0, None, None, None, written, None, out_dtype, None, None, window,
        scale, split=split,
    )  # fmt: skip


def selects_split_planes(kernel: str, out_dtype: torch.dtype, head_dim: int, device_index: int) -> bool:
    """Whether `kernel` runs float32 q, k, v of `head_dim` (aligned; no LSE, no key counts) on this CUDA device
    with a kernel that reads split planes; False where it cannot run them at all (attention then says why)."""
    try:
        variant = resolve(kernel, torch.float32, out_dtype, head_dim, device_index, aligned=True).selection.variant
    except NoKernelError:
        return False
    return variant is not None and variant.spec.operands == "split_planes"


def _written(
    variant: Variant, shape: tuple[int, int, int], out: torch.Tensor | None, out_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """What `variant` writes, token-major `shape` in its output dtype: `out` where that is `out_dtype`."""
    kernel_dtype = DTYPES[variant.out_dtype]
    if kernel_dtype == out_dtype and out is not None:
        return out
    return torch.empty(shape, dtype=kernel_dtype, device=device)


def _in_place_or_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if contiguous or readable by TMA in place (the tensor-map kernels), else a contiguous copy."""
    return tensor if tensor.is_contiguous() or tensor_maps.readable(tensor) else tensor.contiguous()


def _checked_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`out`, once checked against the destination a kernel writes: contiguous `shape` `dtype` on `device`,
    16-byte aligned."""
    if out.shape != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} {shape} tensor on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.data_ptr() % 16:
        raise ValueError(f"out must be 16-byte aligned, got address {out.data_ptr():#x} (a view with an offset?)")
    return out


_resolved: dict[tuple[Any, ...], Prepared] = {}
_disabled: dict[int, dict[str, str]] = {}
_lock = threading.Lock()


def resolve(
    kernel: str, in_dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, device_index: int, aligned: bool,
    key_lens: bool = False, lse: bool = False, short_keys: bool = False, key_bias: bool = False,
) -> Prepared:  # fmt: skip
    """The selection for these inputs on this device (`key_lens`: with per-batch key counts; `lse`: with
    the log-sum-exp; `short_keys`: at most `registry.SHORT_KEYS` keys; `key_bias`: with a bias per key), its
    builds loaded, memoised."""
    key = (kernel, in_dtype, out_dtype, head_dim, device_index, aligned, key_lens, lse, short_keys, key_bias)
    prepared = _resolved.get(key)
    if prepared is None:
        capability, shared_limit = nvrtc.device_facts(device_index)
        problem = Problem(
            DTYPE_NAMES[in_dtype],
            DTYPE_NAMES[out_dtype],
            head_dim,
            capability,
            shared_limit,
            aligned,
            key_lens,
            lse,
            short_keys,
            key_bias,
        )
        with _lock:
            prepared = _resolved[key] = _prepare(problem, kernel, device_index)
    return prepared


def _prepare(problem: Problem, kernel: str, device_index: int) -> Prepared:
    """`select_kernel`'s choice, built and loaded on the device with the prepass its operands need. "auto"
    disables a kernel that cannot be prepared here (warning once, with the reason) and selects again; a
    named kernel raises NoKernelError."""
    disabled = _disabled.setdefault(device_index, {})
    while True:
        selection = select_kernel(problem, kernel, disabled)
        variant = selection.variant
        if variant is None:
            return Prepared(selection)
        builds = (variant, prepass_for(variant))
        try:
            if variant.spec.operands in ("tensor_maps", "quantized"):
                tensor_maps.check_driver()
            return Prepared(selection, *(nvrtc.function(build, device_index) for build in builds if build is not None))
        except ImportError:
            raise
        except Exception as error:  # a build or load failure disables the kernel with its reason
            reason = f"the {variant.spec.name} kernel could not be prepared ({type(error).__name__}: {error})"
        if kernel != "auto":
            raise NoKernelError(f"kernel={kernel!r} cannot run here: {reason}")
        disabled[variant.spec.name] = reason
        warnings.warn(f"pictor-diffusers: {reason}; using the next kernel", RuntimeWarning, stacklevel=4)


def cannot_run(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> str | None:  # fmt: skip
    """Why `kernel` cannot run these CUDA inputs on their device (None if it can)."""
    aligned = not (query.data_ptr() | key.data_ptr() | value.data_ptr()) % 16
    try:
        resolve(kernel, query.dtype, out_dtype or query.dtype, query.shape[-1], query.device.index, aligned)
    except NoKernelError as error:
        return str(error)
    return None
