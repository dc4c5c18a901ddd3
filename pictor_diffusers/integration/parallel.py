"""Context parallelism for `PictorAttn`: Ulysses, ring, and unified ring x Ulysses attention.

`transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=U, ring_degree=R))` makes
diffusers split FLUX's text and image tokens, and their position ids (hence the RoPE tables), along the
sequence across the U x R ranks, and records the config on every processor as `_parallel_config`. Each
rank runs pictor's fused prologue on its own tokens (head-major q, k, v `[B, H, n_r, D]`); then:

* Ulysses (R = 1): an all-to-all over heads gives every rank H/U heads of the whole sequence,
  `[B, H/U, N, D]`, its tokens in rank order (RoPE is already applied per token, and unmasked attention
  does not depend on the order of the keys, so this order serves as well as the model's); the kernel
  runs on them, token-major `[B, N, (H/U)*D]`; the reverse all-to-all sends each rank its own tokens
  back with all heads, `[B, n_r, H*D]`, heads in model order.
* Ring (U = 1): `ring.py`: this rank's queries meet every rank's keys as the shards travel round the
  ring, partial results merged by their log-sum-exp.
* Unified: the Ulysses exchange within each Ulysses group, ring attention across the ring group on the
  gathered `[B, H/U, n_r*U, D]`, then the reverse exchange. A ring group joins ranks of one Ulysses
  index, so it holds one head block of every token.

Shards may be uneven where diffusers allows it (`ulysses_anything`, `ring_anything`); the heads must
divide by U.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .ring import AttendLse, Ring, gathered_lengths, ring_attention

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Head-major q, k, v `[B, h, N, D]` -> token-major `[B, N, h*D]`."""


class Ulysses(NamedTuple):
    """The Ulysses process group of a context-parallel config, its size P, and whether shards may be uneven."""

    group: dist.ProcessGroup
    degree: int
    uneven: bool


class ContextParallel(NamedTuple):
    """The groups of a context-parallel config: Ulysses, ring, or both (unified)."""

    ulysses: Ulysses | None
    ring: Ring | None


def _mesh_group(context: Any, name: str, degree: int) -> dist.ProcessGroup | None:
    if degree <= 1:
        return None
    mesh = getattr(context, f"_{name}_mesh", None)
    if mesh is None:
        raise RuntimeError(
            f"PictorAttn got a context-parallel config ({name}_degree={degree}) without a device mesh: "
            "set it with transformer.enable_parallelism(config=...)"
        )
    return mesh.get_group()


def context_parallel(config: Any) -> ContextParallel | None:
    """The groups of a processor's `_parallel_config`; None without context parallelism.

    Raises RuntimeError, naming the degree, for a config that `enable_parallelism` has not set up.
    """
    context = getattr(config, "context_parallel_config", None)
    if context is None:
        return None
    ulysses_degree, ring_degree = context.ulysses_degree, context.ring_degree
    ulysses_group = _mesh_group(context, "ulysses", ulysses_degree)
    ring_group = _mesh_group(context, "ring", ring_degree)
    ulysses = None
    if ulysses_group is not None:
        ulysses = Ulysses(ulysses_group, ulysses_degree, bool(getattr(context, "ulysses_anything", False)))
    ring = None if ring_group is None else Ring(ring_group, ring_degree, bool(getattr(context, "ring_anything", False)))
    return ContextParallel(ulysses, ring)


def check_local_rope(rope: tuple[torch.Tensor, torch.Tensor] | None, tokens: int) -> None:
    """Under context parallelism the RoPE tables must cover this rank's `tokens` tokens only."""
    if rope is not None and rope[0].shape[0] != tokens:
        raise ValueError(
            f"PictorAttn under context parallelism: this rank holds {tokens} tokens but the RoPE tables have "
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
    return gathered_lengths(tokens, ulysses.group, ulysses.degree, device)


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
        ulysses: the group (`context_parallel`).
        attend: the attention call on `[B, H/P, N, D]` inputs.

    Returns:
        token-major `[B, n_r, H*D]` in `attend`'s output dtype: this rank's queries against every key.
    """
    _, heads, tokens, _ = query.shape
    _check_heads(heads, ulysses.degree)
    lengths = _local_lengths(tokens, ulysses, query.device)
    gathered = [heads_to_sequence(t, lengths, ulysses.group) for t in (query, key, value)]
    return sequence_to_heads(attend(*gathered), lengths, tokens, ulysses.group)


def context_parallel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: ContextParallel, attend: Attend,
    attend_lse: AttendLse,
) -> torch.Tensor:  # fmt: skip
    """This rank's queries `[B, H, n_r, D]` against the keys of every rank: token-major `[B, n_r, H*D]`.

    `attend` serves Ulysses, `attend_lse` (with log-sum-exp) ring and unified attention.
    """
    if groups.ring is None:
        return ulysses_attention(query, key, value, groups.ulysses, attend)
    ring = partial(ring_attention, ring=groups.ring, attend=attend_lse)
    if groups.ulysses is None:
        return ring(query, key, value)
    return ulysses_attention(query, key, value, groups.ulysses, ring)
