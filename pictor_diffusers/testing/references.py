"""float64 references, input makers and error metrics shared by the GPU tests and benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_qkv(
    batch: int, heads: int, seq: int, head_dim: int, seed: int, device: str = "cuda", scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh N(0, scale^2) float32 head-major `[B, H, N, D]` q, k, v."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    return tuple(torch.randn(shape, generator=generator, device=device) * scale for _ in range(3))


def attention_float64(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads_per_chunk: int = 8
) -> torch.Tensor:
    """Exact-as-possible reference: float64 SDPA, token-major `[B, Nq, H*D]` float64 (q `[B, H, Nq, D]`,
    k and v `[B, H, Nk, D]`).

    Runs over head chunks so the float64 score matrices stay a few GB.
    """
    batch, heads, seq, head_dim = query.shape
    chunks = []
    for start in range(0, heads, heads_per_chunk):
        part = slice(start, start + heads_per_chunk)
        chunks.append(
            F.scaled_dot_product_attention(query[:, part].double(), key[:, part].double(), value[:, part].double())
        )
    return torch.cat(chunks, dim=1).transpose(1, 2).reshape(batch, seq, heads * head_dim)


def lse_float64(query: torch.Tensor, key: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Natural log-sum-exp of each row's scaled logits in float64, `[B, Nq, H]` (q `[B, H, Nq, D]`,
    k `[B, H, Nk, D]`; scale defaults to D**-0.5), one head at a time."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rows = [
        torch.logsumexp(query[:, h].double() @ key[:, h].double().transpose(-1, -2) * scale, dim=-1)
        for h in range(query.shape[1])
    ]
    return torch.stack(rows, dim=-1)


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """4·B·H·N²·D: two matrix products of 2·N²·D each, per head."""
    return 4.0 * batch * heads * seq * seq * head_dim


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_2 / ||expected||_2, computed in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute elementwise difference, in float64."""
    return (actual.double() - expected.double()).abs().max().item()
