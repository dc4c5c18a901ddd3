"""pictor as a diffusers attention backend: `model.set_attention_backend("pictor")`.

Every model whose processors call diffusers' `dispatch_attention_fn` (FLUX.1,
FLUX.2's stock processors, Qwen-Image, Wan, HunyuanVideo, LTX, ...) can then run
its attention on pictor's kernels:

    import pictor_diffusers  # registers the backends
    transformer.set_attention_backend("pictor")
    with attention_backend("pictor_bf16"): ...

Names follow `PictorAttn(precision=...)`:

* "pictor" (precision "fp32", the parity contract): q, k, v upcast to float32,
  attention at f32 accuracy, the result rounded once to the inputs' dtype.
* "pictor_bf16" / "pictor_fp16" (the fast path): q, k, v rounded once to the
  16-bit dtype, 16-bit tensor cores with f32 accumulation and f32 softmax,
  the result in the inputs' dtype. On a bf16 model "pictor_bf16" is
  `precision="auto"`; "pictor_fp16" turns values beyond 65504 into inf.

Registration happens on `import pictor_diffusers` (one explicit call at the end
of the package's `__init__`); `register_backends()` is idempotent. diffusers
offers no public way to add a backend: its `AttentionBackendName` enum is closed
and `_AttentionBackendRegistry` is private. Both are feature-detected (they have
kept one layout from diffusers 0.36 to 0.42); on any other layout nothing is
changed and one warning says what is missing, so `import pictor_diffusers`
never fails because of it.

`DIFFUSERS_ATTN_BACKEND=pictor` (or another pictor name) works when
`pictor_diffusers` is imported before anything imports diffusers' models:
diffusers reads the variable into its enum at import, before pictor's names
exist, so for that one import pictor lets it read "native" and then makes the
requested pictor backend active. Other values are left alone.

The dispatcher hands q, k, v token-major `[B, N, H, D]`; they are copied once
to head-major contiguous `[B, H, N, D]` in the compute dtype (the kernels read
that layout), and the kernel's token-major `[B, N, H*D]` output is returned as
a `[B, N, H, D]` view, without a copy. Served: non-causal attention without
mask or dropout, Nq == Nk, equal q/k/v heads and head_dim (1..384), float32 /
bfloat16 / float16 on CPU or CUDA, inference (no autograd recording). Any
other call (a mask, is_causal, dropout_p > 0, Nq != Nk as in cross-attention,
grouped-query heads, a parallel config, another dtype or head_dim, gradients)
runs diffusers' native backend, with one warning per reason naming it; masks
are never dropped. `return_lse=True` raises: neither pictor nor the native
backend returns the log-sum-exp.

Context parallelism: registered with `supports_context_parallel=False`, so
diffusers refuses `enable_parallelism` with these backends. Ring attention
merges per-shard results by their log-sum-exp, which pictor's kernels do not
output yet.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable
from enum import Enum
from types import ModuleType
from typing import Any

import torch

from .ops import attention
from .registry import MAX_HEAD_DIM
from .validation import OUT_DTYPE_CHOICES, check_scale

BACKENDS: dict[str, torch.dtype] = {
    "pictor": torch.float32,
    "pictor_bf16": torch.bfloat16,
    "pictor_fp16": torch.float16,
}
"""Backend name -> the dtype q, k, v are computed in (`PictorAttn` precision "fp32", "bf16", "fp16")."""

DISPATCH_MODULE = "diffusers.models.attention_dispatch"
_MAX_GRID = 65535
_WARNED: set[str] = set()
_NATIVE_ARGS = {"query", "key", "value", "attn_mask"}


def _warn_once(key: str, message: str, stacklevel: int = 3) -> None:
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
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    parallel_config: Any,
) -> tuple[str, str] | None:
    """(reason key, what it is) when pictor's kernels cannot serve the call, else None."""
    if attn_mask is not None:
        return "attn_mask", f"attention masks (attn_mask of shape {tuple(attn_mask.shape)})"
    if is_causal:
        return "is_causal", "causal attention (is_causal=True)"
    if dropout_p:
        return "dropout_p", f"attention dropout (dropout_p={dropout_p})"
    if parallel_config is not None:
        return "parallel_config", "context parallelism (a _parallel_config)"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or key.shape != value.shape:
        return "layout", f"q/k/v shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
    if key.shape[1] != query.shape[1]:
        return "kv_length", f"keys of another length than the queries (Nq={query.shape[1]} != Nk={key.shape[1]})"
    if key.shape != query.shape:
        return "heads", f"grouped-query or mismatched heads/head_dim (q {tuple(query.shape)}, k {tuple(key.shape)})"
    if query.dtype not in OUT_DTYPE_CHOICES or key.dtype != query.dtype or value.dtype != query.dtype:
        return "dtype", f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (pictor takes one of f32/bf16/f16)"
    if query.device.type not in ("cpu", "cuda") or key.device != query.device or value.device != query.device:
        return "device", f"devices {query.device}, {key.device}, {value.device}"
    batch, seq, heads, head_dim = query.shape
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        return "head_dim", f"head_dim={head_dim} (pictor takes 1..{MAX_HEAD_DIM})"
    if seq < 1 or not 1 <= batch <= _MAX_GRID or not 1 <= heads <= _MAX_GRID:
        return "extent", f"B={batch}, N={seq}, H={heads} (pictor takes N >= 1 and B, H in 1..{_MAX_GRID})"
    if scale is not None:
        try:
            check_scale(float(scale))
        except ValueError:
            return "scale", f"scale={scale}"
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return "autograd", "gradients (autograd records this call; pictor's kernels are inference-only)"
    return None


def _profiling() -> bool:
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return enabled is not None and not torch.compiler.is_compiling() and enabled()


def _head_major(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[B, N, H, D]` -> contiguous `[B, H, N, D]` in `dtype`, in one copy (none if already laid out so)."""
    tensor = tensor.transpose(1, 2)
    if tensor.dtype == dtype:
        return tensor.contiguous()
    return tensor.to(dtype=dtype, memory_format=torch.contiguous_format)


def _serve(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, compute: torch.dtype
) -> torch.Tensor:
    """`[B, N, H, D]` q, k, v -> pictor attention -> `[B, N, H, D]` in the inputs' dtype.

    One copy in per tensor (head-major contiguous in `compute`), none out: the
    kernel writes token-major `[B, N, H*D]`, returned as a view.
    """
    batch, seq, heads, head_dim = query.shape
    dtype = query.dtype
    q, k, v = (_head_major(t, compute) for t in (query, key, value))
    out_dtype = dtype if compute == torch.float32 else compute
    out = attention(q, k, v, scale, out_dtype=out_dtype, kernel="auto")
    return out.to(dtype).view(batch, seq, heads, head_dim)


def _make_backend(name: str, compute: torch.dtype, registry: Any, native_member: Enum) -> Callable[..., torch.Tensor]:
    """The backend function for `name`, with the parameter names diffusers' dispatcher passes."""

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
    ) -> torch.Tensor:
        if return_lse:
            raise NotImplementedError(
                f"the {name!r} attention backend does not return the log-sum-exp (return_lse=True); "
                "neither does diffusers' native backend, which pictor falls back to"
            )
        problem = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, scale, _parallel_config)
        if problem is None:
            if _profiling():
                with torch.profiler.record_function("pictor::attention"):
                    return _serve(query, key, value, scale, compute)
            return _serve(query, key, value, scale, compute)
        reason, detail = problem
        _warn_once(
            reason,
            f"pictor-diffusers: the {name!r} attention backend does not serve {detail}; such calls run "
            "diffusers' native attention instead (warned once per reason)",
            stacklevel=4,  # the model's processor, which called dispatch_attention_fn
        )
        native = registry._backends[native_member]
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
        accepted = registry._supported_arg_names.get(native_member) or _parameters(native)
        return native(**{arg: given[arg] for arg in given if arg in accepted})

    backend.__name__ = backend.__qualname__ = f"_{name}_attention"
    backend._pictor_backend = name
    return backend


def _parameters(fn: Any) -> set[str]:
    """Parameter names of `fn`; empty when it has no inspectable signature."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def import_dispatcher() -> ModuleType:
    """diffusers' dispatcher module, imported so that DIFFUSERS_ATTN_BACKEND=<a pictor name> does not
    break it: for that first import diffusers' constant reads "native" (see the module docstring)."""
    if DISPATCH_MODULE in sys.modules:
        return sys.modules[DISPATCH_MODULE]
    constants = importlib.import_module("diffusers.utils.constants")
    requested = getattr(constants, "DIFFUSERS_ATTN_BACKEND", None)
    if requested not in BACKENDS:
        return importlib.import_module(DISPATCH_MODULE)
    constants.DIFFUSERS_ATTN_BACKEND = "native"
    try:
        return importlib.import_module(DISPATCH_MODULE)
    finally:
        constants.DIFFUSERS_ATTN_BACKEND = requested


def _layout_problem(dispatch: ModuleType) -> str | None:
    """What the dispatcher lacks of the private layout pictor relies on, or None."""
    names = getattr(dispatch, "AttentionBackendName", None)
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    if not (isinstance(names, type) and issubclass(names, str) and issubclass(names, Enum)):
        return "no str Enum AttentionBackendName"
    maps = {"_member_map_": dict, "_value2member_map_": dict, "_member_names_": list}
    missing = [attr for attr, kind in maps.items() if not isinstance(names.__dict__.get(attr), kind)]
    if missing or "native" not in names._value2member_map_:
        return f"AttentionBackendName lacks {missing or 'a native member'}"
    if registry is None:
        return "no _AttentionBackendRegistry"
    tables = ("_backends", "_constraints", "_supported_arg_names")
    missing = [attr for attr in tables if not isinstance(getattr(registry, attr, None), dict)]
    if missing:
        return f"_AttentionBackendRegistry lacks the tables {missing}"
    if "constraints" not in _parameters(getattr(registry, "register", None)):
        return "_AttentionBackendRegistry.register(backend, constraints, ...) is missing or has another signature"
    native = registry._backends.get(names("native"))
    if not callable(native) or not _NATIVE_ARGS <= _parameters(native):
        return "no native backend taking (query, key, value, attn_mask)"
    return None


def _add_member(names: type[Enum], member_name: str, value: str) -> Enum | None:
    """Add `member_name = value` to the closed str enum `names`; the member, or None (rolled back)
    when this Python's enum does not then look it up by value, by name and as an attribute."""
    existing = names._value2member_map_.get(value)
    if existing is not None:
        return existing
    template = names._value2member_map_["native"]
    member = str.__new__(names, value)
    member._name_, member._value_ = member_name, value
    member.__objclass__ = names
    if hasattr(template, "_sort_order_"):
        member._sort_order_ = len(names._member_names_)
    type.__setattr__(names, member_name, member)
    names._member_names_.append(member_name)
    names._member_map_[member_name] = member
    names._value2member_map_[value] = member
    try:
        found = names(value) is member and names[member_name] is member and getattr(names, member_name) is member
    except (KeyError, ValueError, AttributeError):
        found = False
    if found and value in {m.value for m in names.__members__.values()}:
        return member
    _remove_member(names, member_name, value)
    return None


def _remove_member(names: type[Enum], member_name: str, value: str) -> None:
    names._value2member_map_.pop(value, None)
    names._member_map_.pop(member_name, None)
    if member_name in names._member_names_:
        names._member_names_.remove(member_name)
    if member_name in names.__dict__:
        type.__delattr__(names, member_name)


def _add_members(names: type[Enum], registry: Any) -> list[Enum] | None:
    """The members of `BACKENDS` in `names`, added where missing; None (nothing added) if any fails."""
    added = [_add_member(names, name.upper(), name) for name in BACKENDS]
    if None not in added:
        return added
    for member, name in zip(added, BACKENDS, strict=True):
        if member is not None and registry._backends.get(member) is None:
            _remove_member(names, name.upper(), name)
    return None


def register_backends(dispatch: ModuleType | None = None) -> tuple[str, ...]:
    """Register `BACKENDS` with diffusers' attention dispatcher; idempotent.

    Args:
        dispatch: the dispatcher module (default: diffusers' own, imported by
            `import_dispatcher`).

    Returns:
        the names registered, or () when the dispatcher's private layout is
        unknown (one RuntimeWarning says what is missing; nothing is changed).
    """
    dispatch = import_dispatcher() if dispatch is None else dispatch
    problem = _layout_problem(dispatch)
    added = None if problem else _add_members(dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry)
    if added is None:
        version = getattr(sys.modules.get("diffusers"), "__version__", "?")
        problem = problem or "this Python's Enum does not take added members"
        _warn_once(
            "registry",
            f"pictor-diffusers: diffusers {version}'s attention dispatcher has an unknown layout ({problem}); "
            "the pictor attention backends are not registered. PictorAttn is unaffected.",
        )
        return ()
    names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
    native = names("native")
    takes_cp_flag = "supports_context_parallel" in _parameters(registry.register)
    registered = []
    for member, (name, compute) in zip(added, BACKENDS.items(), strict=True):
        current = registry._backends.get(member)
        if current is not None and getattr(current, "_pictor_backend", None) != name:
            _warn_once(f"taken:{name}", f"pictor-diffusers: diffusers already has a backend named {name!r}; kept")
            continue
        registered.append(name)
        if current is not None:
            continue
        options = {"constraints": list(registry._constraints.get(native, []))}
        if takes_cp_flag:
            options["supports_context_parallel"] = False
        registry.register(member, **options)(_make_backend(name, compute, registry, native))
    _activate_requested(names, registry)
    return tuple(registered)


def _activate_requested(names: type[Enum], registry: Any) -> None:
    """Make DIFFUSERS_ATTN_BACKEND's pictor backend active, if it names one and diffusers is on native."""
    constants = sys.modules.get("diffusers.utils.constants")
    requested = getattr(constants, "DIFFUSERS_ATTN_BACKEND", None)
    if requested in BACKENDS and getattr(registry, "_active_backend", None) == names("native"):
        registry._active_backend = names(requested)
