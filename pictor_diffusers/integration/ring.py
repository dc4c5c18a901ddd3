"""Ring attention for `PictorAttn`: key/value shards passed around a ring, partial results merged by log-sum-exp.

With `ContextParallelConfig(ring_degree=P)` every rank of the ring holds its own queries and keys. Each of
P steps attends this rank's queries to one rank's keys and values, starting with its own, while the shard
it holds moves on to the next rank (rank r sends to r+1 and receives from r-1, one `all_to_all_single`
whose wait is deferred until the next step needs the data, so the exchange overlaps the kernel). The
partial outputs are merged exactly by their log-sum-exp in float32:

    lse = logaddexp(lse_a, lse_b),    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Shards may differ in length (`ring_anything`): the lengths are gathered once per call and each receive is
sized by its sender's. Only two shards are alive at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

AttendLse = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""Head-major q `[B, h, n, D]`, k, v `[B, h, m, D]` -> (token-major `[B, n, h*D]`, lse `[B, n, h]` float32)."""


class Ring(NamedTuple):
    """The ring process group of a context-parallel config, its size P, and whether shards may be uneven."""

    group: dist.ProcessGroup
    degree: int
    uneven: bool


def gathered_lengths(tokens: int, group: dist.ProcessGroup, degree: int, device: torch.device) -> list[int]:
    """Every rank's `tokens`, in group-rank order: one small all-gather (on CPU for a gloo group)."""
    backend = str(dist.get_backend(group))
    where = torch.device("cpu") if backend == "gloo" or "cpu:" in backend else device
    lengths = torch.empty(degree, dtype=torch.int64, device=where)
    dist.all_gather_into_tensor(lengths, torch.tensor([tokens], dtype=torch.int64, device=where), group=group)
    return lengths.tolist()


def _rotate(buffer: torch.Tensor, incoming: int, ring: Ring) -> torch.Tensor:
    """Start sending 1-D `buffer` to the next rank and receiving `incoming` elements from the previous one.

    Returns the (possibly still in flight) received tensor; its first use waits for it.
    """
    rank = dist.get_rank(ring.group)
    send = [0] * ring.degree
    receive = [0] * ring.degree
    send[(rank + 1) % ring.degree] = buffer.numel()
    receive[(rank - 1) % ring.degree] = incoming
    return funcol.all_to_all_single(buffer, receive, send, ring.group)


def merge_partial(
    out: torch.Tensor | None, lse: torch.Tensor | None, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one partial result into the running (out `[B, n, h, D]` f32, lse `[B, n, h]` f32)."""
    batch, tokens, heads = part_lse.shape
    part = part.view(batch, tokens, heads, -1).float()
    if out is None or lse is None:
        return part, part_lse
    merged = torch.logaddexp(lse, part_lse)
    out = out * torch.exp(lse - merged).unsqueeze(-1) + part * torch.exp(part_lse - merged).unsqueeze(-1)
    return out, merged


def ring_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: Ring, attend: AttendLse
) -> torch.Tensor:
    """This rank's queries against the keys of every rank of the ring.

    Args:
        query: `[B, h, n, D]`; key, value: `[B, h, m, D]`, this rank's shards, head-major, contiguous.
        ring: the group (`parallel.context_parallel`).
        attend: the attention call with log-sum-exp on one pair of shards.

    Returns:
        token-major `[B, n, h*D]` in `attend`'s output dtype.
    """
    batch, heads, _, dim = key.shape
    owner = dist.get_rank(ring.group)
    if ring.uneven:
        lengths = gathered_lengths(key.shape[2], ring.group, ring.degree, key.device)
    else:
        lengths = [key.shape[2]] * ring.degree
    buffer = torch.cat([key.reshape(-1), value.reshape(-1)])
    out = lse = None
    for step in range(ring.degree):
        last = step == ring.degree - 1
        source = (owner - step - 1) % ring.degree
        incoming = None if last else _rotate(buffer, 2 * batch * heads * lengths[source] * dim, ring)
        shard_key, shard_value = (key, value) if step == 0 else buffer.view(2, batch, heads, -1, dim).unbind(0)
        part, part_lse = attend(query, shard_key, shard_value)
        out_dtype = part.dtype
        out, lse = merge_partial(out, lse, part, part_lse)
        if incoming is not None:
            buffer = incoming.wait() if isinstance(incoming, funcol.AsyncCollectiveTensor) else incoming
    return out.view(batch, -1, heads * dim).to(out_dtype)
