"""Which kernel runs an attention problem, and why not the others: a pure function of plain facts.

`select_kernel` takes a `Problem` (dtypes, head_dim, the device's capability and shared-memory limit,
alignment, key counts, log-sum-exp, short key sequences; no GPU, no tensors) and the rows of `registry.py`,
and returns the `Selection`: the build that runs it, or torch's SDPA (`SDPA`) where that runs a 16-bit call
faster here, with every rejected candidate's reason; `NoKernelError` when none can. `blocker` says why one
row cannot. Tested on CPU for every combination; `plan.resolve` memoises it per device and loads the build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from .registry import BY_NAME, KERNELS, MAX_HEAD_DIM, KernelSpec, Variant, family_of, variant_for


@dataclass(frozen=True)
class Problem:
    """The facts that decide which kernel runs: inputs and device, no tensors.

    `aligned`: q, k and v start on 16-byte boundaries (tensor cores read 16-byte vectors).
    `key_lens`: the call gives per-batch key counts (the kernels' key-count builds run it).
    `lse`: the call asks for the log-sum-exp (which torch's SDPA does not return).
    `short_keys`: the call attends at most `registry.SHORT_KEYS` keys (a row's persistent build runs it).
    `key_bias`: the call adds a bias per key to the logits (only rows with key-bias builds take it).
    """

    in_dtype: str
    out_dtype: str
    head_dim: int
    capability: tuple[int, int]
    shared_limit: int
    aligned: bool = True
    key_lens: bool = False
    lse: bool = False
    short_keys: bool = False
    key_bias: bool = False


SDPA = "sdpa"
"""The `Selection.delegate` that hands a 16-bit call to torch's `scaled_dot_product_attention`."""


@dataclass(frozen=True)
class Selection:
    """The chosen variant, or `delegate` (`SDPA`, variant None) for a call torch's SDPA runs faster;
    `upcast`: 16-bit inputs run the f32 kernels as float32; `rejected`: (kernel, reason) for each
    candidate tried before it."""

    variant: Variant | None
    upcast: bool
    rejected: tuple[tuple[str, str], ...]
    delegate: str | None = None


class NoKernelError(ValueError):
    """No kernel can run the problem; the message lists each candidate's reason."""


def blocker(spec: KernelSpec, problem: Problem) -> str | None:
    """Why `spec` cannot run `problem` (inputs already float32 for the f32 family), or None."""
    if problem.in_dtype not in spec.in_dtypes:
        return f"takes {'/'.join(spec.in_dtypes)} inputs, not {problem.in_dtype}"
    if problem.head_dim not in spec.head_dims:
        allowed = f"<= {MAX_HEAD_DIM}" if spec.name == "f32" else f"in {spec.head_dims}"
        return f"needs head_dim {allowed}, got {problem.head_dim}"
    if spec.exact_capability is not None and problem.capability != spec.exact_capability:
        return f"needs compute capability {spec.exact_capability}, the device has {problem.capability}"
    if problem.capability < spec.min_capability:
        return f"needs compute capability {spec.min_capability}+, the device has {problem.capability}"
    if problem.key_bias and spec.key_bias_bytes is None:
        return "takes no key bias (float attention masks): only the wgmma kernel (Hopper, 16-bit) does"
    if problem.key_bias and problem.key_lens:
        return "takes a key bias or key counts, not both"
    needed = variant_for(
        spec, problem.head_dim, "float32", "float32", short_keys=problem.short_keys, key_bias=problem.key_bias
    ).shared_bytes
    if needed > problem.shared_limit:
        return f"needs {needed} bytes of shared memory per block, the device allows {problem.shared_limit}"
    if spec.name != "f32" and not problem.aligned:
        return "q, k or v is not 16-byte aligned"
    return None


def _candidates(problem: Problem, kernel: str) -> list[tuple[KernelSpec | None, bool]]:
    """(spec, upcast) in the order tried, None standing for SDPA: the requested kernel, or the family's
    "auto" order. 16-bit "auto": the kernels measured at least as fast as SDPA on this device, then
    SDPA itself, then the other 16-bit kernels and the f32 kernels on upcast inputs (fresh float32
    copies, so aligned) for what SDPA cannot serve (LSE, key counts)."""
    family = family_of(problem.in_dtype)
    if kernel != "auto":
        return [(BY_NAME[kernel], False)]
    own = [spec for spec in KERNELS if spec.family == family]
    if family != "16bit":
        return [(spec, False) for spec in own]
    tuned = [spec for spec in own if (problem.capability, problem.head_dim) in (spec.beats_sdpa_on or ())]
    rest = [(spec, False) for spec in own if spec not in tuned]
    upcast = [(spec, True) for spec in KERNELS if spec.family == "fp32"]
    return [*((spec, False) for spec in tuned), (None, False), *rest, *upcast]


def _sdpa_blocker(problem: Problem) -> str | None:
    """Why torch's SDPA cannot serve `problem` under pictor's contract, or None."""
    if problem.lse:
        return "does not return the log-sum-exp"
    if problem.key_lens:
        return "gives NaN, not 0, for a batch with no keys"
    if problem.key_bias:
        return "is not handed pictor's key bias (the wgmma kernel adds it)"
    return None


def select_kernel(problem: Problem, kernel: str = "auto", disabled: Mapping[str, str] | None = None) -> Selection:
    """The kernel that runs `problem`: the requested one, or the first "auto" candidate that can.

    Args:
        problem: inputs and device facts.
        kernel: "auto" or a name from `KERNEL_CHOICES` (already checked against the family).
        disabled: kernel name -> reason, for kernels that failed to build or load here.

    Raises:
        NoKernelError: no candidate can run it; the message gives every reason.
    """
    disabled = disabled or {}
    rejected: list[tuple[str, str]] = []
    for spec, upcast in _candidates(problem, kernel):
        if spec is None:
            reason = _sdpa_blocker(problem)
            if reason is None:
                return Selection(None, False, tuple(rejected), SDPA)
            rejected.append((SDPA, reason))
            continue
        in_dtype = "float32" if upcast else problem.in_dtype
        as_run = replace(problem, in_dtype="float32", aligned=True) if upcast else problem
        reason = disabled.get(spec.name) or blocker(spec, as_run)
        if reason is None:
            writes = spec.writes(in_dtype)
            out_dtype = problem.out_dtype if problem.out_dtype in writes else writes[0]
            variant = variant_for(
                spec, problem.head_dim, in_dtype, out_dtype, problem.key_lens, problem.short_keys, problem.key_bias
            )
            return Selection(variant, upcast, tuple(rejected))
        rejected.append((spec.name + (" (upcast)" if upcast else ""), reason))
    reasons = "; ".join(f"{name}: {reason}" for name, reason in rejected)
    raise NoKernelError(f"kernel={kernel!r} cannot run {problem.in_dtype} head_dim={problem.head_dim}: {reasons}")
