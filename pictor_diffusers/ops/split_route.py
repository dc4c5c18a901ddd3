"""The parity path's fused route: the prologue writes the fp16x3 kernel's split planes, the kernel reads them.

Where the plan for float32 q, k, v runs the split-planes kernel (fp16x3: "auto" on Hopper at head_dim 128,
or by name) on CUDA, `PictorAttn` calls `split_attention` in place of `pack_head_major` + `attention`: the
split prologue (`kernels/qkv_prologue_split.cu`) turns the projections into the planes and column maxima
the split prepass would make of the prologue's f32 q, k, v, bit for bit, and the attention plan reads them
with no prepass (`plan.plan_split_attention`): no f32 q, k, v round trip, the same output.

`takes_split_route` is the one routing decision; the caller keeps the unfused route for what needs q, k, v
themselves (FLUX.2's KV cache: its gap and windows; context parallelism). Under `torch.compile` or autograd
the two steps are `torch.ops.pictor.qkv_prologue_split` and `torch.ops.pictor.attention_split` (fakes for
tracing, no graph break), and the decision is taken once while tracing (a constant of the device). On the
CPU each step runs its twin (`split_reference`).
"""

from __future__ import annotations

import torch

from ..cuda import plan_memo
from ..cuda.geometry import SplitPlanes, split_halves
from ..cuda.launch import qkv_prologue_split_cuda, run, split_qkv_cuda
from ..cuda.plan import plan_split_attention, selects_split_planes
from ..cuda.prologue_layout import prologue_layout
from ..dtypes import DTYPE_NAMES, DTYPES
from .custom_ops import inference_op, needs_op
from .prologue import Rope, Segment, pack_head_major_torch, rms_args, rms_norms, rope_tables
from .reference import twin_attention
from .split_reference import joined_twin, split_twin
from .validation import check_split_planes


@torch.compiler.assume_constant_result
def _selects_split(kernel: str, out_dtype: str, head_dim: int, device_type: str, device_index: int) -> bool:
    """Whether `kernel` runs float32 q, k, v of `head_dim` on the split-planes kernel on this device (CUDA only;
    `plan.selects_split_planes`). Under torch.compile it runs once while tracing, its answer a constant."""
    return device_type == "cuda" and selects_split_planes(kernel, DTYPES[out_dtype], head_dim, device_index)


def takes_split_route(segments: list[Segment], head_dim: int, kernel: str, out_dtype: torch.dtype) -> bool:
    """Whether `split_attention` serves this parity-path call: RMSNorm QK norms (the fused prologue's), and a
    `kernel` choice that runs the split-planes kernel on float32 q, k, v of `head_dim` on the projections'
    device."""
    if not rms_norms(segments):
        return False
    device = segments[-1].query.device
    return _selects_split(kernel, DTYPE_NAMES[out_dtype], head_dim, device.type, device.index or 0)


def split_attention(
    segments: list[Segment], head_dim: int, rope: Rope | None, kernel: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """`attention(*pack_head_major(segments, head_dim, rope), out_dtype=out_dtype, kernel=kernel)` on the fused
    route (`takes_split_route`): token-major `[B, N, H*D]` in `out_dtype`, the same values."""
    projections, weights, eps = rms_args(segments, head_dim)
    rope_list = rope_tables(rope, segments[-1].query.device)
    scale = head_dim**-0.5
    if needs_op(*projections):
        planes, colmax = torch.ops.pictor.qkv_prologue_split(projections, weights, rope_list, eps)
        heads, seq = _heads(projections, head_dim), sum(p.shape[1] for p in projections[::3])
        return torch.ops.pictor.attention_split(planes, colmax, heads, seq, scale, kernel, DTYPE_NAMES[out_dtype])
    split = _prologue_split(projections, weights, rope_list, eps, eager=True)
    return _attend_split(split, scale, kernel, out_dtype)


def _heads(projections: list[torch.Tensor], head_dim: int) -> int:
    """H of `[B, n, H*D]` projections."""
    return projections[-1].shape[-1] // head_dim


def _prologue_split(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float],
    eager: bool = False,
) -> SplitPlanes:  # fmt: skip
    """The split prologue kernel for CUDA projections in a layout it takes; else the torch prologue, then the
    split (its kernel on CUDA, its twin on the CPU): what `qkv_prologue` and the split give either way.
    `eager` (not inside the custom op): planes and maxima may share one allocation."""
    layout = prologue_layout(projections, weights, rope, eps)
    if layout is not None and layout.device_index >= 0:
        return qkv_prologue_split_cuda(layout, one_allocation=eager)
    query, key, value = pack_head_major_torch(projections, weights, rope, eps)
    if query.is_cuda:
        return split_qkv_cuda(query, key, value, one_allocation=eager)
    return split_twin(query, key, value)


def _attend_split(split: SplitPlanes, scale: float, kernel: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Attention on split planes: the split-planes kernel's plan on CUDA (replayed when planes with the same
    facts were served before: `plan_memo.split_call_key`), the twin on the planes' values on the CPU;
    token-major `[B, N, H*D]` `out_dtype`."""
    if split.planes.is_cuda:
        call = plan_memo.split_call_key(split, scale, kernel, out_dtype)
        replayed = plan_memo.launch_replay(call)
        if replayed is not None:
            return replayed
        check_split_planes(split)
        return run(plan_memo.remember_split(call, plan_split_attention(split, scale, kernel, out_dtype)))
    check_split_planes(split)
    return twin_attention(*joined_twin(split), scale, kernel, out_dtype)


def _prologue_split_fake(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    image, head_dim = projections[-1], weights[0].shape[0]
    seq, groups = sum(p.shape[1] for p in projections[::3]), image.shape[0] * _heads(projections, head_dim)
    planes = image.new_empty((split_halves(groups, seq, seq, head_dim),), dtype=torch.float16)
    return planes, image.new_empty((3, groups, head_dim), dtype=torch.int32)


@inference_op("qkv_prologue_split", _prologue_split_fake, "the prologue")
def _prologue_split_op(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    split = _prologue_split(projections, weights, rope, eps)
    return split.planes, split.colmax


def _attention_split_fake(
    planes: torch.Tensor, colmax: torch.Tensor, heads: int, seq: int, scale: float, kernel: str, out_dtype: str
) -> torch.Tensor:
    _, groups, head_dim = colmax.shape
    return planes.new_empty((groups // heads, seq, heads * head_dim), dtype=DTYPES[out_dtype])


@inference_op("attention_split", _attention_split_fake, "attention")
def _attention_split_op(
    planes: torch.Tensor, colmax: torch.Tensor, heads: int, seq: int, scale: float, kernel: str, out_dtype: str
) -> torch.Tensor:
    return _attend_split(SplitPlanes(planes, colmax, heads, seq), scale, kernel, DTYPES[out_dtype])
