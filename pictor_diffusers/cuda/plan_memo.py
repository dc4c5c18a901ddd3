"""Plans of repeated attention calls, resolved once: the host fast path.

A model calls attention with the same shapes, strides and dtypes at every layer and step, and PyTorch's caching
allocator hands the same addresses back step after step. `call_key` names a call by every fact its launch depends
on (addresses, shapes, strides, dtypes and devices of q, k, v and the key counts; the scale, kernel and out
dtype as passed);
`remember` keeps the plan of a call once its launch is built, and `launch_replay` runs it for a call with the
same key, into a fresh output, the launch arguments already built. A replayed call skips validation (its facts
passed it before), the kernel's resolution and the input maps' encodes: it costs the key, one allocation and the
launch (the wgmma kernel's output map is looked up again when the output moved); an fp16x3 call's also the
split's workspace, its memset and the split's two launches (`split_replay`).

Remembered: calls whose kernel reads q, k, v (and the key counts, if given) as given (no copy, no upcast; the
fp16x3 kernel's split prepass replayed with it, `split_replay`) into a new output of the requested dtype, over
all rows, without log-sum-exp; and attention on the split planes the parity path's fused prologue made
(`split_call_key`, `remember_split`). Key counts are named by
their tensor's facts too (the backend passes the same cached counts for every call under one mask). No tensor
is held, so a remembered call keeps nothing alive; tensor maps stay referenced by their entry. At most
`MEMO_SIZE` entries, the oldest evicted first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from . import launch
from .geometry import SplitPlanes, full_window
from .plan import AttentionPlan
from .split_replay import SplitReplay

MEMO_SIZE = 512
"""Entries kept: more than the distinct attention calls of one step of the largest diffusers models."""
_PREPARED_OPERANDS = ("pointers", "tensor_maps", "split_planes")


class _Entry(NamedTuple):
    """A remembered plan without its tensors (its `launch` prepared), and the output's shape, dtype and device."""

    plan: AttentionPlan
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    device: torch.device


_memo: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
_lock = threading.Lock()


def call_key(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, kernel: str,
    out_dtype: torch.dtype | None, key_lens: torch.Tensor | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """Every fact an attention call's launch depends on (tensors' addresses, extents, strides, dtypes, devices)."""
    call = (
        query.data_ptr(), key.data_ptr(), value.data_ptr(), query.shape, key.shape, value.shape,
        query.stride(), key.stride(), value.stride(), query.dtype, key.dtype, value.dtype,
        query.get_device(), key.get_device(), value.get_device(), scale, kernel, out_dtype,
    )  # fmt: skip
    if key_lens is None:
        return call
    lens = (key_lens.data_ptr(), key_lens.shape, key_lens.stride(), key_lens.dtype, key_lens.get_device())
    return (*call, *lens)


def launch_replay(call: tuple[Any, ...], shape: torch.Size | None = None) -> torch.Tensor | None:
    """Launch the remembered plan of `call` into a new output and return it, or None when none is remembered.
    The output is the entry's token-major `[B, Nq, H*D]`, or `shape` where given: the same elements, contiguous,
    in another grouping (diffusers' backend asks for the query's `[B, Nq, H, D]`, which saves a view)."""
    entry = _memo.get(call)
    if entry is None:
        return None
    out = torch.empty(entry.out_shape if shape is None else shape, dtype=entry.out_dtype, device=entry.device)
    launch.launch_attention(entry.plan, out)
    return out


def remember(
    call: tuple[Any, ...],
    plan: AttentionPlan,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_lens: torch.Tensor | None = None,
) -> AttentionPlan:
    """`plan` with its launch built (`launch.attention_launch`), remembered under `call` when the plan
    qualifies (see the module's docstring); otherwise `plan` unchanged."""
    variant = plan.selection.variant
    qualifies = (
        variant is not None
        and variant.spec.operands in _PREPARED_OPERANDS
        and plan.query is query
        and plan.key is key
        and plan.value is value
        and plan.out is None
        and plan.lse is None
        and plan.key_lens is key_lens
        and plan.written.dtype == plan.out_dtype
        and plan.split is None
        and plan.window == full_window(query, key)
    )
    if not qualifies:
        return plan
    split = variant.spec.operands == "split_planes"
    plan = plan._replace(launch=SplitReplay(plan) if split else launch.prepare(plan))
    _store_template(call, plan)
    return plan


def split_call_key(split: SplitPlanes, scale: float, kernel: str, out_dtype: torch.dtype) -> tuple[Any, ...]:
    """Every fact attention on split planes (`ops.split_route`) depends on: the planes' and the maxima's
    addresses, extents, strides, dtypes and devices, the heads and rows, the scale, kernel and out dtype."""
    planes, colmax = split.planes, split.colmax
    return (
        "split", planes.data_ptr(), planes.shape, planes.stride(), planes.dtype, planes.get_device(),
        colmax.data_ptr(), colmax.shape, colmax.stride(), colmax.dtype, colmax.get_device(),
        split.heads, split.seq, scale, kernel, out_dtype,
    )  # fmt: skip


def remember_split(call: tuple[Any, ...], plan: AttentionPlan) -> AttentionPlan:
    """A plan on split planes (`plan.plan_split_attention`) with its launch built, remembered under `call`
    (`split_call_key`'s) when its kernel writes the requested dtype; otherwise `plan` unchanged."""
    if plan.selection.variant is None or plan.written.dtype != plan.out_dtype or plan.split is None:
        return plan
    plan = plan._replace(launch=launch.prepare(plan))
    _store_template(call, plan)
    return plan


def _store_template(call: tuple[Any, ...], plan: AttentionPlan) -> None:
    """Remember `plan` (its launch prepared) without its tensors: their addresses are in the launch."""
    template = plan._replace(query=None, key=None, value=None, written=None, key_lens=None, split=None)
    _store(call, _Entry(template, tuple(plan.written.shape), plan.written.dtype, plan.written.device))


def alias(call: tuple[Any, ...], remembered_call: tuple[Any, ...]) -> bool:
    """Remember under `call` too the entry of `remembered_call` (a caller's own key for a call whose tensors,
    as `call` names them, are the remembered call's, viewed); whether there was one."""
    entry = _memo.get(remembered_call)
    if entry is not None:
        _store(call, entry)
    return entry is not None


def _store(call: tuple[Any, ...], entry: _Entry) -> None:
    with _lock:
        _memo[call] = entry
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)


def remembered() -> int:
    """How many calls the memo holds (for tests)."""
    return len(_memo)


def forget() -> None:
    """Empty the memo (for tests)."""
    with _lock:
        _memo.clear()
