"""The 8-bit quantisation study's support: its inputs, error metrics and the bf16 path's torch model.

`benchmarks/quant_study.py`, `bench_fp8_accuracy.py` and the 8-bit tests compare the schemes of
`pictor_diffusers.ops.quant_reference` with these; nothing here runs in the plugin.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..ops.quant_reference import K_TILE, LOG2E
from .references import max_abs, rel_l2

InputSet = Literal["normal", "k_offset", "peaky", "v_offset"]
INPUT_SETS = ("normal", "k_offset", "peaky", "v_offset")


def bf16_path_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """The current bf16 fast path: bf16 inputs, f32 logits and exp2 online softmax over 128-key tiles,
    P rounded to bf16 for P·V (l from the f32 P), f32 accumulation, output rounded to bf16.

    Args: as `int8_fp8_attention` (inputs rounded to bfloat16 first). Returns: `[B, Nq, H*D]` bfloat16.
    """
    batch, heads, seq, head_dim = query.shape
    scale_log2 = (head_dim**-0.5 if scale is None else scale) * LOG2E
    q, k, v = (t.to(torch.bfloat16).float() for t in (query, key, value))
    running_max = torch.full((batch, heads, seq, 1), float("-inf"))
    running_sum = torch.zeros((batch, heads, seq, 1))
    acc = torch.zeros((batch, heads, seq, head_dim))
    for start in range(0, k.shape[2], K_TILE):
        logits = (q @ k[:, :, start : start + K_TILE].transpose(-1, -2)) * scale_log2
        new_max = torch.maximum(running_max, logits.amax(dim=-1, keepdim=True))
        correction = torch.exp2(running_max - new_max)
        probs = torch.exp2(logits - new_max)
        running_sum = running_sum * correction + probs.sum(dim=-1, keepdim=True)
        acc = acc * correction + probs.bfloat16().float() @ v[:, :, start : start + K_TILE]
        running_max = new_max
    out = (acc / running_sum).to(torch.bfloat16)
    return out.transpose(1, 2).contiguous().view(batch, seq, heads * head_dim)


def cosine_similarity(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Cosine of the angle between the flattened tensors, in float64."""
    a, e = actual.double().flatten(), expected.double().flatten()
    return (a @ e / (a.norm() * e.norm())).item()


def rel_l1(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """sum|actual - expected| / sum|expected|, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).abs().sum() / expected.abs().sum()).item()


def error_metrics(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """{"cos", "rel_l1", "rel_l2", "max_abs"} of `actual` against `expected` (same shape)."""
    metrics = {"cos": cosine_similarity, "rel_l1": rel_l1, "rel_l2": rel_l2, "max_abs": max_abs}
    return {name: metric(actual, expected) for name, metric in metrics.items()}


def study_inputs(
    kind: InputSet, batch: int, heads: int, seq: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The study's float32 `[B, H, N, D]` q, k, v: "normal" N(0, 1); "k_offset" ("v_offset") the same plus a
    5-sigma per-(b, h, channel) offset on K (V) shared by all tokens; "peaky" q and k x4 (logits ~N(0, 16^2))."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, generator=generator) for _ in range(3))
    offset = 5.0 * torch.randn((batch, heads, 1, head_dim), generator=generator)
    if kind not in INPUT_SETS:
        raise ValueError(f"unknown input set {kind!r}; expected one of {INPUT_SETS}")
    if kind == "peaky":
        q, k = q * 4.0, k * 4.0
    return q, k + offset if kind == "k_offset" else k, v + offset if kind == "v_offset" else v
