"""The function diffusers' attention dispatcher calls for a pictor backend ("pictor", "pictor_bf16", ...).

The dispatcher hands q `[B, Nq, H, D]`, k and v `[B, Nk, H, D]`, token-major. Served calls pass them on
as `[B, H, N, D]` views: the Hopper 16-bit kernel reads them in place through its tensor maps; for the
other kernels, or another compute dtype, each is copied once to head-major contiguous. The kernel's
token-major `[B, Nq, H*D]` output is returned as a `[B, Nq, H, D]` view, without a copy; with
`return_lse=True` also the log-sum-exp, `[B, Nq, H]` float32 (natural log).

Served: non-causal attention without dropout, any Nq and Nk (Wan's text cross-attention), equal
q/k/v heads and head_dim (1..384), float32 / bfloat16 / float16 on CPU or CUDA, inference (no autograd
recording), float masks the same for every query row (LTX-Video's additive `[B, H, 1, Nk]` mask of 0 and
-10000, any other bias per key) as a key bias where the kernel adds one (`mask_bias`: the Hopper 16-bit kernel
and the CPU twins; no read, no host sync), key-padding masks otherwise (`key_padding.padding_of`, read once per
mask object: Qwen-Image's boolean `[B, 1, 1, Nk]` text-padding mask, holes anywhere; float ones of 0 and
<= -1000), and
context parallelism (`_parallel_config`) without a mask: diffusers' own Ulysses / ring /
unified templates run around pictor's kernel, the ring merging by pictor's log-sum-exp. A key-padding mask
costs at most one gather of k and v (none when padding sits at the end), putting each batch's kept keys first,
and the kernels attend each batch's first `key_lens[b]` keys. Any other call (another mask, is_causal,
dropout_p > 0, grouped-query heads, another dtype or head_dim, gradients) runs diffusers' native backend,
with one warning per reason naming it; masks are never dropped.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from enum import Enum
from types import ModuleType
from typing import Any

import torch

from ..cuda import plan_memo
from ..cuda.plan import resolve
from ..cuda.registry import BY_NAME, MAX_HEAD_DIM
from ..cuda.selection import NoKernelError
from ..ops.attention import attention, memo_key
from ..ops.custom_ops import no_backward
from ..ops.validation import MAX_PLANES, MAX_SEQ, OUT_DTYPE_CHOICES, check_scale
from .key_padding import DROPPED_AT, KeyPadding, padding_of
from .mask_bias import key_bias_of, takes_key_bias

_MAX_GRID = 65535
_WARNED: set[str] = set()
Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """One RuntimeWarning per `key` per process (stacklevel 3: the caller's caller)."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _unsupported(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    mask_served: bool,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> tuple[str, str] | None:
    """(reason key, what it is) when pictor's kernels cannot serve the call, else None
    (`mask_served`: `attn_mask` is served, as a key bias or as key padding)."""
    if attn_mask is not None and not mask_served:
        shape, dtype = tuple(attn_mask.shape), attn_mask.dtype
        if attn_mask.is_floating_point():
            rule = f"0 kept, <= {DROPPED_AT:g} dropped, alike over heads and queries, a key kept per batch"
            what = "float masks that vary over queries, or, where the kernel adds no key bias, other than key padding"
            return "float_attn_mask", f"{what} ({rule}; attn_mask {dtype} {shape})"
        return "attn_mask", f"attention masks other than boolean key padding (attn_mask {dtype} {shape})"
    if is_causal:
        return "is_causal", "causal attention (is_causal=True)"
    if dropout_p:
        return "dropout_p", f"attention dropout (dropout_p={dropout_p})"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape != value.shape:
        return "layout", f"q/k/v shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
    if key.shape[0] != query.shape[0] or key.shape[2:] != query.shape[2:]:
        return "heads", f"grouped-query or mismatched heads/head_dim (q {tuple(query.shape)}, k {tuple(key.shape)})"
    if query.dtype not in OUT_DTYPE_CHOICES or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtype", f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (pictor takes one of f32/bf16/f16)"
    if query.device.type not in ("cpu", "cuda") or key.device != query.device or value.device != query.device:
        return "device", f"devices {query.device}, {key.device}, {value.device}"
    batch, seq, heads, head_dim = query.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return "head_dim", f"head_dim={head_dim} (pictor takes 1..{MAX_HEAD_DIM})"
    seqs_fit = 1 <= min(seq, key.shape[1]) and max(seq, key.shape[1]) <= MAX_SEQ
    if not seqs_fit or not 1 <= batch <= _MAX_GRID or not 1 <= heads <= _MAX_GRID or batch * heads > MAX_PLANES:
        extent = f"B={batch}, Nq={seq}, Nk={key.shape[1]}, H={heads}"
        return "extent", f"{extent} (pictor takes Nq, Nk in 1..{MAX_SEQ}, B, H in 1..{_MAX_GRID}, B*H <= {MAX_PLANES})"
    if scale is not None:
        try:
            check_scale(float(scale))
        except ValueError:
            return "scale", f"scale={scale}"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "autograd", "gradients (autograd records this call; pictor's kernels are inference-only)"
    return None


def _gathered(tensor: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k or v `[B, Nk, H, D]` -> `[B, H, Nk, D]` in `dtype`, its token rows picked by `rows` (`KeyPadding.rows`:
    each batch's kept keys first) in one gather, returned as `_head_major` returns it."""
    batch, seq_k, heads, head_dim = tensor.shape
    picked = tensor.reshape(batch * seq_k, heads, head_dim).index_select(0, rows)
    return _head_major(picked.view(batch, seq_k, heads, head_dim), dtype)


_PROFILER_ENABLED = getattr(torch.autograd, "_profiler_enabled", None)


def _profiling() -> bool:
    """Whether torch's profiler records (outside compiled graphs): such calls take the full, labelled path."""
    return _PROFILER_ENABLED is not None and not torch.compiler.is_compiling() and _PROFILER_ENABLED()


def _replay_key(name: str, query: object, key: object, value: object, scale: object) -> tuple | None:
    """A `plan_memo` key for an unmasked, non-causal, dropout-free call on backend `name`, eagerly on CUDA with no
    autograd recording or profiler (the checks a served call passed depend only on what the key names), or None.
    A remembered key replays the call's kernel launch directly (`make_backend`), skipping every check and copy."""
    call = memo_key(query, key, value, scale, "backend", None, False, None)
    if call is None or _profiling():  # profiled calls take the full path, which labels them
        return None
    return (name, *call)


def _head_major(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, N, H, D]` -> `[B, H, N, D]` in `dtype`: a view when the dtype is already `dtype` (the Hopper
    kernel reads it in place; `attention` copies it for the others), else one cast to contiguous."""
    tensor = tensor.transpose(1, 2)
    if tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype=dtype, memory_format=torch.contiguous_format)


def _runnable(kernel: str, compute: torch.dtype, tensors: tuple[torch.Tensor, ...], masked: bool) -> str:
    """`kernel`, or "auto" (pictor's 16-bit path, one warning per reason) where the named 8-bit kernel cannot
    take the dispatcher's q, k, v `[B, N, H, D]` once in `compute`: another head_dim, or, on CUDA in eager
    mode, a device or build it cannot run (`plan.resolve`). Under torch.compile only the head_dim is
    checked (resolving reads data pointers and loads kernels; the kernel's own error names any other
    reason) and the fallback is not warned about (dynamo cannot trace `warnings.warn`).
    """
    query = tensors[0]
    head_dim, head_dims = query.shape[-1], BY_NAME[kernel].head_dims
    reason = None
    if head_dim not in head_dims:
        reason = f"head_dim={head_dim} (the {kernel!r} kernel takes {head_dims})"
    elif query.device.type == "cuda" and not torch.compiler.is_compiling():
        in_place = query.dtype == compute  # else each tensor is cast into a new, aligned one
        aligned = not in_place or not any(t.data_ptr() % 16 for t in tensors)
        try:
            resolve(kernel, compute, compute, head_dim, query.device.index, aligned, key_lens=masked)
        except NoKernelError as error:
            reason = str(error)
    if reason is None:
        return kernel
    if not torch.compiler.is_compiling():  # dynamo cannot trace warnings.warn; the choice is the same
        warn_once(
            f"{kernel}:{reason}",
            f"pictor-diffusers: the 8-bit path cannot take this attention call ({reason}); such calls run "
            "pictor's 16-bit path instead (warned once per reason)",
            stacklevel=5,  # the model's processor, which called dispatch_attention_fn
        )
    return "auto"


def _serve(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, compute: torch.dtype,
    kernel: str, return_lse: bool, padding: KeyPadding | None = None, replay_key: tuple | None = None,
    key_bias: torch.Tensor | None = None,
) -> Output:  # fmt: skip
    """q `[B, Nq, H, D]`, k, v `[B, Nk, H, D]` (and a key-padding mask, `key_padding.padding_of`'s, or a key bias
    `[B, 1 or H, Nk]`, `mask_bias.key_bias_of`'s) -> pictor
    attention with `kernel` ("auto", or an 8-bit kernel where it can run) -> `[B, Nq, H, D]` in the inputs'
    dtype (and the LSE `[B, Nq, H]` float32 when asked).

    No copy in where the kernel reads token-major q/k/v in place (the Hopper 16-bit kernel, inputs in
    `compute`), else one per tensor (head-major contiguous in `compute`); with a mask whose kept keys are
    not already first in every batch, k and v are gathered kept keys first (one `index_select` each). None
    out: the kernel writes token-major `[B, Nq, H*D]`, returned as a view.
    """
    batch, seq, heads, head_dim = query.shape
    dtype = query.dtype
    q = _head_major(query, compute)
    if padding is None:
        k, v, key_lens = _head_major(key, compute), _head_major(value, compute), None
    else:
        gather = padding.rows is not None
        k = _gathered(key, padding.rows, compute) if gather else _head_major(key, compute)
        v = _gathered(value, padding.rows, compute) if gather else _head_major(value, compute)
        key_lens = padding.key_lens
    out_dtype = dtype if compute == torch.float32 else compute
    result = attention(
        q, k, v, scale, out_dtype=out_dtype, return_lse=return_lse, key_lens=key_lens, key_bias=key_bias, kernel=kernel
    )
    out, lse = result if return_lse else (result, None)
    if replay_key is not None and padding is None and key_bias is None and dtype == compute:  # views of the caller's
        plan_memo.alias(replay_key, plan_memo.call_key(q, k, v, scale, kernel, out_dtype))
    out = (out if out.dtype == dtype else out.to(dtype)).view(batch, seq, heads, head_dim)
    return (out, lse) if return_lse else out


def _forward_op(compute: torch.dtype, kernel: str) -> Callable[..., Output]:
    """pictor as the forward op of diffusers' context-parallel templates (Ulysses, ring, unified)."""

    def forward_op(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
        dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, return_lse: bool,
        _save_ctx: bool = True, _parallel_config: Any = None,
    ) -> Output:  # fmt: skip
        return _serve(query, key, value, scale, compute, kernel, return_lse)

    return forward_op


def context_parallel_template(dispatch: ModuleType) -> Callable[..., Output] | None:
    """diffusers' `_templated_context_parallel_attention`, if this version has it with the keywords pictor
    passes; None otherwise (then the backends are registered without context parallelism)."""
    template = getattr(dispatch, "_templated_context_parallel_attention", None)
    return template if {"forward_op", "backward_op", "_parallel_config"} <= parameters(template) else None


def make_backend(
    name: str, compute: torch.dtype, kernel: str, registry: Any, native_member: Enum,
    template: Callable[..., Output] | None,
) -> Callable[..., Output]:  # fmt: skip
    """The backend function for `name`, with the parameter names diffusers' dispatcher passes.

    `compute`: q, k, v's dtype for the kernel; `kernel`: "auto" or an 8-bit kernel, chosen per call where it
    can run (`_runnable`); `template`: diffusers' context-parallel template (`context_parallel_template`), or None.
    """
    forward_ops = {choice: _forward_op(compute, choice) for choice in {kernel, "auto"}}

    def backend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _parallel_config: Any = None,
    ) -> Output:
        fast = None
        if attn_mask is None and _parallel_config is None and not (return_lse or is_causal or dropout_p):
            fast = _replay_key(name, query, key, value, scale)
            replayed = None if fast is None else plan_memo.launch_replay(fast, query.shape)
            if replayed is not None:
                return replayed
        padding = bias = None
        if attn_mask is not None:
            batch, heads, seq_k = query.shape[0], query.shape[-2], key.shape[1]
            bias = key_bias_of(attn_mask, batch, heads, seq_k)
            if bias is not None and not takes_key_bias(kernel, compute, (query, key, value)):
                bias = None
            padding = None if bias is not None else padding_of(attn_mask, batch, heads, seq_k)
        served = padding is not None or bias is not None
        problem = _unsupported(query, key, value, attn_mask, served, dropout_p, is_causal, scale)
        if problem is None and _parallel_config is not None and template is None:
            problem = ("parallel_config", "context parallelism (this diffusers has no context-parallel template)")
        if problem is None and _parallel_config is not None and attn_mask is not None:
            problem = ("parallel_mask", "a key-padding mask under context parallelism")
        if problem is None:
            chosen = (
                kernel if kernel == "auto" else _runnable(kernel, compute, (query, key, value), padding is not None)
            )
            if _parallel_config is not None:
                call = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse)
                return template(
                    *call,
                    forward_op=forward_ops[chosen],
                    backward_op=no_backward,
                    _parallel_config=_parallel_config,
                )
            if _profiling():
                with torch.profiler.record_function("pictor::attention"):
                    return _serve(query, key, value, scale, compute, chosen, return_lse, padding, key_bias=bias)
            return _serve(query, key, value, scale, compute, chosen, return_lse, padding, fast, bias)
        reason, detail = problem
        if return_lse:
            raise NotImplementedError(
                f"the {name!r} attention backend does not serve {detail}, and diffusers' native backend, "
                "which it falls back to, does not return the log-sum-exp (return_lse=True)"
            )
        warn_once(
            reason,
            f"pictor-diffusers: the {name!r} attention backend does not serve {detail}; such calls run "
            "diffusers' native attention instead (warned once per reason)",
            stacklevel=4,  # the model's processor, which called dispatch_attention_fn
        )
        given = {
            "query": query,
            "key": key,
            "value": value,
            "attn_mask": attn_mask,
            "dropout_p": dropout_p,
            "is_causal": is_causal,
            "scale": scale,
            "enable_gqa": enable_gqa,
            "_parallel_config": _parallel_config,
        }
        native = registry._backends[native_member]
        accepted = registry._supported_arg_names.get(native_member) or parameters(native)
        return native(**{arg: given[arg] for arg in given if arg in accepted})

    backend.__name__ = backend.__qualname__ = f"_{name}_attention"
    backend._pictor_backend = name
    return backend


def parameters(fn: Any) -> set[str]:
    """Parameter names of `fn`; empty when it is not callable or has no inspectable signature."""
    if not callable(fn):
        return set()
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
