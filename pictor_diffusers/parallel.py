"""Ulysses sequence parallelism for `PictorAttn`: the all-to-all exchange around the attention kernel.

`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=P))` makes diffusers split
FLUX's text and image tokens, and their position ids (hence the RoPE tables), along the sequence across
the P ranks of the Ulysses group, and records the config on every processor as `_parallel_config`. Each
rank then runs pictor's fused prologue on its own tokens (head-major q, k, v `[B, H, n_r, D]`), and:

1. an all-to-all over heads gives every rank H/P heads of the whole sequence, `[B, H/P, N, D]`, its
   tokens in rank order (RoPE is already applied per token, and unmasked attention does not depend on
   the order of the keys, so this order serves as well as the model's);
2. the attention kernel runs on them: token-major `[B, N, (H/P)*D]`;
3. the reverse all-to-all sends each rank its own tokens back with all heads, `[B, n_r, H*D]`,
   heads in model order.

Served: Ulysses (ring_degree=1), equal shards (diffusers' default sharder requires each split input to
divide by P) or, with `ulysses_anything=True`, uneven ones (local lengths gathered once per call). The
heads must divide by P. Refused: ring and unified ring x Ulysses attention, which merge partial results
by their log-sum-exp, an output pictor's kernels do not have yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Head-major q, k, v `[B, h, N, D]` -> token-major `[B, N, h*D]`."""


class Ulysses(NamedTuple):
    """The Ulysses process group of a context-parallel config, its size P, and whether shards may be uneven."""

    group: dist.ProcessGroup
    degree: int
    uneven: bool


def ulysses_group(config: Any) -> Ulysses | None:
    """The Ulysses group of a processor's `_parallel_config`; None without context parallelism.

    Raises NotImplementedError, naming the degrees, for ring and unified ring x Ulysses configs, and
    RuntimeError for a config that `enable_parallelism` has not set up.
    """
    context = getattr(config, "context_parallel_config", None)
    if context is None:
        return None
    ulysses, ring = context.ulysses_degree, context.ring_degree
    if ring > 1:
        raise NotImplementedError(
            f"PictorAttn serves Ulysses context parallelism only (ContextParallelConfig(ulysses_degree=P), "
            f"ring_degree=1); got ulysses_degree={ulysses}, ring_degree={ring}. Ring and unified ring x Ulysses "
            "attention merge per-shard results by their log-sum-exp, which pictor's kernels do not return yet: "
            "use ulysses_degree, or diffusers' own processors for ring attention."
        )
    mesh = getattr(context, "_ulysses_mesh", None)
    if mesh is None:
        raise RuntimeError(
            f"PictorAttn got a context-parallel config (ulysses_degree={ulysses}) without a device mesh: "
            "set it with transformer.enable_parallelism(config=...)"
        )
    return Ulysses(mesh.get_group(), ulysses, bool(getattr(context, "ulysses_anything", False)))


def check_local_rope(rope: tuple[torch.Tensor, torch.Tensor] | None, tokens: int) -> None:
    """Under context parallelism the RoPE tables must cover this rank's `tokens` tokens only."""
    if rope is not None and rope[0].shape[0] != tokens:
        raise ValueError(
            f"PictorAttn under Ulysses: this rank holds {tokens} tokens but the RoPE tables have "
            f"{rope[0].shape[0]} rows. diffusers' FLUX.2 cp plan splits img_ids/txt_ids only when they are "
            "3-D [B, N, 4], as the FLUX.2 pipelines pass them"
        )


def _check_heads(heads: int, degree: int) -> None:
    if heads % degree:
        raise ValueError(
            f"PictorAttn under Ulysses splits the {heads} attention heads across ulysses_degree={degree} ranks "
            f"and needs them divisible by it ({heads} % {degree} = {heads % degree}); diffusers' "
            "ulysses_anything pads heads, PictorAttn does not"
        )


def _local_lengths(tokens: int, ulysses: Ulysses, device: torch.device) -> list[int]:
    """Every rank's local sequence length, in group-rank order (one small all-gather when shards may be uneven)."""
    if not ulysses.uneven:
        return [tokens] * ulysses.degree
    backend = str(dist.get_backend(ulysses.group))
    where = torch.device("cpu") if backend == "gloo" or "cpu:" in backend else device
    lengths = torch.empty(ulysses.degree, dtype=torch.int64, device=where)
    dist.all_gather_into_tensor(lengths, torch.tensor([tokens], dtype=torch.int64, device=where), group=ulysses.group)
    return lengths.tolist()


def _all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Flat all-to-all of contiguous `x`: `send[j]` elements to rank j; returns what each rank j sent, 1-D, by rank."""
    out = funcol.all_to_all_single(x.view(-1), receive, send, group)
    return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def heads_to_sequence(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Head-major `[B, H, n_r, D]` of this rank's tokens -> `[B, H/P, N, D]`, contiguous, N = sum(lengths).

    Rank j receives heads j*H/P .. (j+1)*H/P; the tokens of rank s come as the s-th run of the sequence.
    One copy on receipt (and one on sending when B > 1).
    """
    batch, heads, tokens, dim = x.shape
    degree = len(lengths)
    local_heads = heads // degree
    send = x.view(batch, degree, local_heads, tokens, dim).transpose(0, 1).contiguous()
    block = batch * local_heads * dim
    received = _all_to_all(send, [block * tokens] * degree, [block * n for n in lengths], group)
    runs = received.split([block * n for n in lengths])
    return torch.cat([run.view(batch, local_heads, n, dim) for run, n in zip(runs, lengths, strict=True)], dim=2)


def sequence_to_heads(out: torch.Tensor, lengths: list[int], tokens: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Token-major `[B, N, (H/P)*D]` of this rank's heads -> `[B, n_r, H*D]` of its own `tokens` tokens.

    Heads come back in model order (rank s held heads s*H/P .. (s+1)*H/P). One copy on receipt (and one
    on sending when B > 1).
    """
    batch, _, width = out.shape
    degree = len(lengths)
    send = out.transpose(0, 1).contiguous()
    received = _all_to_all(send, [n * batch * width for n in lengths], [tokens * batch * width] * degree, group)
    return received.view(degree, tokens, batch, width).permute(2, 1, 0, 3).reshape(batch, tokens, degree * width)


def ulysses_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ulysses: Ulysses, attend: Attend
) -> torch.Tensor:
    """Attention over the whole sequence from this rank's tokens.

    Args:
        query, key, value: this rank's tokens, head-major `[B, H, n_r, D]`, contiguous, one dtype.
        ulysses: the group (`ulysses_group`).
        attend: the attention call on `[B, H/P, N, D]` inputs.

    Returns:
        token-major `[B, n_r, H*D]` in `attend`'s output dtype: this rank's queries against every key.
    """
    _, heads, tokens, _ = query.shape
    _check_heads(heads, ulysses.degree)
    lengths = _local_lengths(tokens, ulysses, query.device)
    gathered = [heads_to_sequence(t, lengths, ulysses.group) for t in (query, key, value)]
    return sequence_to_heads(attend(*gathered), lengths, tokens, ulysses.group)
