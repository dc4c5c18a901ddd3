"""The attention prologue: QK RMSNorm, [text, image] join, RoPE, head-major packing.

`pack_head_major` turns FLUX.2's projection outputs into the attention
kernel's inputs. On CUDA it is one launch of `kernels/qkv_prologue.cu` for q,
k and v together, reading the projections in the model dtype where they lie
(strided views of fused projections included); elsewhere, and for layouts the
kernel does not take, `pack_head_major_torch` computes the same in torch.
Both run the norm and RoPE in float32 and round once into the output dtype
(float32 for the parity path, the model's 16-bit dtype for the fast path).
Segments whose QK norms are not all RMSNorms (none, or `torch.nn.LayerNorm`,
as SD3 and CogVideoX have) take a torch path with the same float32 contract.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..cuda.launch import qkv_prologue_cuda
from ..cuda.prologue_layout import prologue_layout
from ..dtypes import DTYPE_NAMES, DTYPES
from .custom_ops import inference_op, needs_op

Rope = tuple[torch.Tensor, torch.Tensor]


class RmsParams(NamedTuple):
    """An RMSNorm over head_dim given by its parameters (for norm modules of other types than
    `torch.nn.RMSNorm` with the same math): weight `[D]` in any float dtype, or None for ones; eps."""

    weight: torch.Tensor | None
    eps: float


QkNorm = torch.nn.Module | RmsParams | None
"""A QK norm over head_dim: `torch.nn.RMSNorm` or `RmsParams` (the fused path), `torch.nn.LayerNorm`, or None."""


class Segment(NamedTuple):
    """One run of tokens: projections `[B, n, H*D]` (model dtype) and its QK norms."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    norm_q: QkNorm
    norm_k: QkNorm


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate `x` `[B, N, H, D]` by diffusers' interleaved-pair RoPE, in float32.

    `rope` is `(cos, sin)`, each `[N, D]`, as FLUX.2's `Flux2PosEmbed` returns
    them: (x[2i], x[2i+1]) -> (x[2i] cos[2i] - x[2i+1] sin[2i], x[2i+1] cos[2i+1] + x[2i] sin[2i+1]).
    """
    cos, sin = (t.to(device=x.device, dtype=torch.float32)[None, :, None, :] for t in rope)
    x = x.float()
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(-2)
    return x * cos + rotated * sin


_COMPUTED = object()
_FLOAT_WEIGHTS = WeakIdKeyDictionary()
"""16-bit norm weight -> (its in-place version, its float32 copy): the cast once per weight, not per call."""


def float_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[D]` as float32: itself if it is; a 16-bit weight's cast is kept while the weight lives
    and is not changed in place (outside compiled graphs, autograd and inference tensors, which get a plain
    cast)."""
    if weight.dtype == torch.float32:
        return weight
    if torch.compiler.is_compiling() or (weight.requires_grad and torch.is_grad_enabled()) or weight.is_inference():
        return weight.float()  # an inference tensor has no version counter to tell an in-place change by
    cached = _FLOAT_WEIGHTS.get(weight)
    if cached is not None and cached[0] == weight._version:
        return cached[1]
    cast = weight.float()
    _FLOAT_WEIGHTS[weight] = (weight._version, cast)
    return cast


def _on_device(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`weight` itself; RuntimeError if it is not on `like`'s device (per-layer offloading)."""
    if weight.device != like.device:
        raise RuntimeError(
            f"PictorAttn reads QK-norm weights directly, but this one is on {weight.device} while the "
            f"projections are on {like.device}; per-layer offloading (enable_sequential_cpu_offload, "
            "leaf-level group offloading) is not supported, enable_model_cpu_offload is"
        )
    return weight


def norm_params(norm: torch.nn.RMSNorm | RmsParams, head_dim: int, like: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(f32 weight `[D]`, eps) of a `torch.nn.RMSNorm` or `RmsParams`; TypeError names any other norm."""
    if isinstance(norm, torch.nn.RMSNorm):
        # A registered parameter is read straight from `_parameters` (Module.__getattr__ costs about
        # 1 µs a call); a parametrized or otherwise computed weight goes through the attribute.
        weight = norm._parameters.get("weight", _COMPUTED)
        if weight is _COMPUTED:
            weight = norm.weight
        eps = norm.eps
    elif isinstance(norm, RmsParams):
        weight, eps = norm
    else:
        raise TypeError(f"PictorAttn expects RMSNorm, LayerNorm or no QK norms, got {type(norm).__name__}")
    if weight is None:
        weight = torch.ones(head_dim, device=like.device)
    eps = eps if eps is not None else torch.finfo(like.dtype).eps
    return float_weight(_on_device(weight, like)), float(eps)


def _normed(projection: torch.Tensor, norm: QkNorm, head_dim: int) -> torch.Tensor:
    """`projection` `[B, n, H*D]` as float32 `[B, n, H, D]`, through `norm` over D in float32 (None: as is)."""
    x = projection.unflatten(-1, (-1, head_dim)).float()
    if norm is None:
        return x
    if not isinstance(norm, torch.nn.LayerNorm):
        return F.rms_norm(x, (head_dim,), *norm_params(norm, head_dim, projection))
    if tuple(norm.normalized_shape) != (head_dim,):
        raise ValueError(f"a LayerNorm QK norm must normalise head_dim={head_dim}, not {norm.normalized_shape}")
    weight, bias = (None if t is None else float_weight(_on_device(t, x)) for t in (norm.weight, norm.bias))
    return F.layer_norm(x, (head_dim,), weight, bias, norm.eps)


def pack_head_major_any_norm(
    segments: list[Segment], head_dim: int, rope: list[torch.Tensor], dtype: torch.dtype, kv_gap: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_head_major` in torch for any `QkNorm`s: q `[B, H, N, D]` and k, v `[B, H, N + kv_gap[1], D]`,
    contiguous in `dtype`; norms and RoPE in float32 (rope: `[cos, sin]` float32 `[N, D]`, or empty)."""
    query = torch.cat([_normed(s.query, s.norm_q, head_dim) for s in segments], dim=1)
    key = torch.cat([_normed(s.key, s.norm_k, head_dim) for s in segments], dim=1)
    value = torch.cat([s.value for s in segments], dim=1).unflatten(-1, (-1, head_dim))
    if rope:
        query, key = apply_rope(query, (rope[0], rope[1])), apply_rope(key, (rope[0], rope[1]))
    query, key, value = (
        t.transpose(1, 2).to(dtype, copy=True, memory_format=torch.contiguous_format) for t in (query, key, value)
    )
    return query, _open_gap(key, *kv_gap), _open_gap(value, *kv_gap)


def _float_table(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A RoPE table as contiguous float32 on `device` (FLUX.2's already is: returned as is)."""
    if table.dtype == torch.float32 and table.device == device and table.is_contiguous():
        return table
    return table.to(device=device, dtype=torch.float32).contiguous()


def rms_segments(projections: list[torch.Tensor], weights: list[torch.Tensor], eps: list[float]) -> list[Segment]:
    """`pictor::qkv_prologue`'s flat arguments (3 or 6 projections, 2 or 4 norm weights and eps) as segments."""
    return [
        Segment(*projections[i : i + 3], RmsParams(weights[j], eps[j]), RmsParams(weights[j + 1], eps[j + 1]))
        for i, j in ((0, 0), (3, 2))[: len(projections) // 3]
    ]


def pack_head_major_torch(
    projections: list[torch.Tensor], weights: list[torch.Tensor], rope: list[torch.Tensor], eps: list[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch prologue; same arguments as `pictor::qkv_prologue` (3 or 6 projections).

    Returns q, k, v as contiguous float32 `[B, H, N, D]`.
    """
    segments = rms_segments(projections, weights, eps)
    return pack_head_major_any_norm(segments, weights[0].shape[0], rope, torch.float32, (0, 0))


def _open_gap(tensor: torch.Tensor, gap_at: int, kv_gap: int) -> torch.Tensor:
    """`[B, H, N, D]` -> `[B, H, N + kv_gap, D]` with rows from `gap_at` on moved `kv_gap` down
    (the gap rows uninitialised), as the kernel writes k and v."""
    if kv_gap == 0:
        return tensor
    batch, heads, seq, head_dim = tensor.shape
    out = tensor.new_empty((batch, heads, seq + kv_gap, head_dim))
    out[:, :, :gap_at] = tensor[:, :, :gap_at]
    out[:, :, gap_at + kv_gap :] = tensor[:, :, gap_at:]
    return out


def _prologue_impl(
    projections: list[torch.Tensor],
    weights: list[torch.Tensor],
    rope: list[torch.Tensor],
    eps: list[float],
    dtype: torch.dtype,
    gap_at: int = 0,
    kv_gap: int = 0,
    eager: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernel for CUDA projections in a layout it takes, else the torch twin (`eager`: not
    inside the custom op, so the kernel's outputs may share one allocation)."""
    layout = prologue_layout(projections, weights, rope, eps)
    if layout is not None and layout.device_index >= 0:
        return qkv_prologue_cuda(layout, dtype, gap_at, kv_gap, one_allocation=eager)
    segments = rms_segments(projections, weights, eps)
    return pack_head_major_any_norm(segments, weights[0].shape[0], rope, dtype, (gap_at, kv_gap))


def _prologue_op_fake(
    projections: list[torch.Tensor],
    weights: list[torch.Tensor],
    rope: list[torch.Tensor],
    eps: list[float],
    out_dtype: str = "float32",
    gap_at: int = 0,
    kv_gap: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    image, head_dim = projections[-1], weights[0].shape[0]
    seq = sum(p.shape[1] for p in projections[::3])
    shape = (image.shape[0], image.shape[-1] // head_dim, seq, head_dim)
    kv_shape = (*shape[:2], seq + kv_gap, head_dim)
    return tuple(image.new_empty(s, dtype=DTYPES[out_dtype]) for s in (shape, kv_shape, kv_shape))


@inference_op("qkv_prologue", _prologue_op_fake, "the prologue")
def _prologue_op(
    projections: list[torch.Tensor],
    weights: list[torch.Tensor],
    rope: list[torch.Tensor],
    eps: list[float],
    out_dtype: str = "float32",
    gap_at: int = 0,
    kv_gap: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _prologue_impl(projections, weights, rope, eps, DTYPES[out_dtype], gap_at, kv_gap)


def pack_head_major(
    segments: list[Segment],
    head_dim: int,
    rope: Rope | None,
    dtype: torch.dtype = torch.float32,
    kv_gap: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, ...]:
    """QK norm, join, RoPE and head-major packing of one or two segments.

    Args:
        segments: [text, image] for double-stream blocks, [all tokens] for
            single-stream blocks; projections `[B, n_i, H*D]` in the model dtype. With
            RMSNorm QK norms (`torch.nn.RMSNorm`, `RmsParams`) the fused path below runs;
            with any other `QkNorm` (LayerNorm, None) `pack_head_major_any_norm`.
        head_dim: D.
        rope: `(cos, sin)`, each `[sum n_i, D]`, or None.
        dtype: float32, bfloat16 or float16 for the outputs (math is f32 either way).
        kv_gap: (at, rows): k and v get `rows` unwritten rows before token `at` (where
            FLUX.2's cached reference-image K/V go); (0, 0) for none.

    Returns:
        q: contiguous `[B, H, N, D]` in `dtype`, N = sum of n_i; k, v: `[B, H, N + rows, D]`.
        On CUDA one launch of the fused prologue kernel where the layout allows it (in eager
        mode without a gap, into one `[3, B, H, N, D]` allocation).
    """
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"pack_head_major writes float32, bfloat16 or float16, got {dtype}")
    rope_list = rope_tables(rope, segments[-1].query.device)
    if not rms_norms(segments):
        return pack_head_major_any_norm(segments, head_dim, rope_list, dtype, kv_gap)
    projections, weights, eps = rms_args(segments, head_dim)
    if needs_op(*projections):
        name = DTYPE_NAMES[dtype]
        return torch.ops.pictor.qkv_prologue(projections, weights, rope_list, eps, name, *kv_gap)
    return _prologue_impl(projections, weights, rope_list, eps, dtype, *kv_gap, eager=True)


def rms_norms(segments: list[Segment]) -> bool:
    """Whether every QK norm of `segments` is an RMSNorm (`torch.nn.RMSNorm`, `RmsParams`): the fused kernels' path."""
    return all(isinstance(norm, (torch.nn.RMSNorm, RmsParams)) for s in segments for norm in (s.norm_q, s.norm_k))


def rope_tables(rope: Rope | None, device: torch.device) -> list[torch.Tensor]:
    """`rope` as the prologue ops take it: `[cos, sin]`, contiguous float32 `[N, D]` on `device`, or empty."""
    return [_float_table(t, device) for t in rope] if rope else []


def rms_args(segments: list[Segment], head_dim: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """The fused prologue ops' projections (3 or 6), norm weights (2 or 4, float32 `[D]`) and eps for segments
    whose QK norms are all RMSNorms (`rms_norms`)."""
    image = segments[-1].query
    params = [norm_params(norm, head_dim, image) for s in segments for norm in (s.norm_q, s.norm_k)]
    projections = [t for segment in segments for t in segment[:3]]
    return projections, [w for w, _ in params], [e for _, e in params]
