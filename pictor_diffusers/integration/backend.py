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
* "pictor_fp8" (the 8-bit path, lossy): q, k, v rounded once to bfloat16, then
  the 8-bit kernel (int8 Q.K, FP8 P.V; Hopper, head_dim 128). Calls it cannot
  take (another head_dim, a GPU other than sm_90) run the "pictor_bf16" path,
  with one warning per reason naming it.

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

What a backend call serves, and what falls back to diffusers' native backend
with a warning, is in `pictor_diffusers.integration.dispatcher_call`: Nq != Nk, the
log-sum-exp (`return_lse=True`) and context parallelism are served; masks,
causal attention and dropout fall back. Context parallelism: the backends are
registered with `supports_context_parallel=True` where diffusers has its
context-parallel template (`_templated_context_parallel_attention`), which
then runs Ulysses, ring and unified attention around pictor's kernel.
"""

from __future__ import annotations

import importlib
import sys
from enum import Enum
from types import ModuleType
from typing import Any, NamedTuple

import torch

from .dispatcher_call import context_parallel_template, make_backend, parameters, warn_once
from .precision import BACKEND_PRECISIONS, PRECISIONS


class Backend(NamedTuple):
    """What a pictor backend computes in: q, k, v's dtype and the kernel choice ("auto" or the 8-bit one)."""

    compute: torch.dtype
    kernel: str = "auto"


BACKENDS: dict[str, Backend] = {
    name: Backend(PRECISIONS[precision].compute, PRECISIONS[precision].kernel)
    for name, precision in BACKEND_PRECISIONS.items()
}
"""Backend name -> its `Backend`, read from `precision.PRECISIONS` (`PictorAttn` precision "fp32", "bf16",
"fp16", "fp8")."""

DISPATCH_MODULE = "diffusers.models.attention_dispatch"
_NATIVE_ARGS = {"query", "key", "value", "attn_mask"}


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
    if "constraints" not in parameters(getattr(registry, "register", None)):
        return "_AttentionBackendRegistry.register(backend, constraints, ...) is missing or has another signature"
    native = registry._backends.get(names("native"))
    if not callable(native) or not _NATIVE_ARGS <= parameters(native):
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
        warn_once(
            "registry",
            f"pictor-diffusers: diffusers {version}'s attention dispatcher has an unknown layout ({problem}); "
            "the pictor attention backends are not registered. PictorAttn is unaffected.",
        )
        return ()
    names, registry = dispatch.AttentionBackendName, dispatch._AttentionBackendRegistry
    native = names("native")
    takes_cp_flag = "supports_context_parallel" in parameters(registry.register)
    template = context_parallel_template(dispatch)
    registered = []
    for member, (name, backend) in zip(added, BACKENDS.items(), strict=True):
        current = registry._backends.get(member)
        if current is not None and getattr(current, "_pictor_backend", None) != name:
            warn_once(f"taken:{name}", f"pictor-diffusers: diffusers already has a backend named {name!r}; kept")
            continue
        registered.append(name)
        if current is not None:
            continue
        options = {"constraints": list(registry._constraints.get(native, []))}
        if takes_cp_flag:
            options["supports_context_parallel"] = template is not None
        function = make_backend(name, backend.compute, backend.kernel, registry, native, template)
        registry.register(member, **options)(function)
    _activate_requested(names, registry)
    return tuple(registered)


def _activate_requested(names: type[Enum], registry: Any) -> None:
    """Make DIFFUSERS_ATTN_BACKEND's pictor backend active, if it names one and diffusers is on native."""
    constants = sys.modules.get("diffusers.utils.constants")
    requested = getattr(constants, "DIFFUSERS_ATTN_BACKEND", None)
    if requested in BACKENDS and getattr(registry, "_active_backend", None) == names("native"):
        registry._active_backend = names(requested)
