"""diffusers' attention masks read as key padding, once per mask.

A model passes one mask object to every attention call of a forward (LTX-Video's additive text mask, Qwen-Image's
and HunyuanVideo's boolean ones), so what the backend derives from it is kept per mask object: whether it is key
padding, the kept counts (the kernels' `key_lens`) and, unless each batch's kept keys already come first, the
gather that puts them first. Reading the values takes one host sync, on the first call only (LTX-Video's
processor repeats its mask per head at every call, so there it is every call); a later call with the same,
unmodified mask costs a dictionary lookup. A mask written in place (its `_version` moves) is read
again. Under torch.compile or CUDA graph capture nothing is cached or read: no float mask is key padding there,
and a boolean one is always gathered. A mask made under `torch.inference_mode` (no version counter) is read on
every call and always gathered, never cached.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

DROPPED_AT = -1000.0
"""An additive float mask value at or below this drops its key: its weight, e^(logit + value - row max), is
exactly 0 in float32 unless the key's logit exceeds the row's largest kept one by ~900."""


class KeyPadding(NamedTuple):
    """A key-padding mask as the kernels take it: `key_lens` `[B]` int32 (kept keys per batch) and `rows`, the
    flat int64 `[B * Nk]` token rows that put each batch's kept keys first, in order (an `index_select` over
    k or v seen as `[B * Nk, H, D]`), or None where every batch's kept keys already come first (padding at the
    end: no gather). Both are new tensors, never views of the mask (a cached view would keep its mask alive)."""

    key_lens: torch.Tensor
    rows: torch.Tensor | None


_derived: WeakIdKeyDictionary = WeakIdKeyDictionary()


def padding_of(attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int) -> KeyPadding | None:
    """`attn_mask` (broadcast to `[B, H, Nq, Nk]` as SDPA does) as key padding, or None when it is not one:
    boolean (`bool_key_padding`) or additive float (`float_key_padding`)."""
    tracing = torch.compiler.is_compiling() or (attn_mask.is_cuda and torch.cuda.is_current_stream_capturing())
    if tracing or attn_mask.is_inference():  # an inference tensor has no version counter: read, never cached
        kept = bool_key_padding(attn_mask, batch, seq_k)
        if kept is None and not tracing:
            kept = float_key_padding(attn_mask, batch, heads, seq_k)
        return None if kept is None else _padding(kept, gather=True)
    key = (attn_mask._version, batch, heads, seq_k)
    cached = _derived.get(attn_mask)
    if cached is not None and cached[0] == key:
        return cached[1]
    padding = _read(attn_mask, batch, heads, seq_k)
    _derived[attn_mask] = (key, padding)
    return padding


def _read(attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int) -> KeyPadding | None:
    """`padding_of`'s answer from the mask's values, in one host sync: whether a float mask is key padding and
    whether each batch's kept keys come before its dropped ones are read together."""
    kept = bool_key_padding(attn_mask, batch, seq_k)
    is_padding = None
    if kept is None:
        found = _float_kept(attn_mask, batch, heads, seq_k)
        if found is None:
            return None
        kept, is_padding = found
    kept_first = (kept[:, 1:] <= kept[:, :-1]).all()
    if is_padding is None:
        return _padding(kept, gather=not kept_first.item())
    is_padding, kept_first = torch.stack((is_padding, kept_first)).tolist()
    return _padding(kept, gather=not kept_first) if is_padding else None


def _padding(kept: torch.Tensor, gather: bool) -> KeyPadding:
    key_lens = kept.sum(1, dtype=torch.int32)
    if not gather:
        return KeyPadding(key_lens, None)
    batch, seq_k = kept.shape
    order = torch.argsort((~kept).to(torch.uint8), dim=1, stable=True)
    starts = torch.arange(0, batch * seq_k, seq_k, device=kept.device)[:, None]
    return KeyPadding(key_lens, (order + starts).flatten())


def bool_key_padding(attn_mask: torch.Tensor, batch: int, seq_k: int) -> torch.Tensor | None:
    """`attn_mask` as a `[B, Nk]` bool key-padding mask (True: attend), or None when it is not one.

    Key padding: bool, and, broadcast as SDPA does to `[B, H, Nq, Nk]` (dims aligned from the right), the
    same for every head and query: `[1, Nk]`, `[1, 1, Nk]` or `[1|B, 1, 1, Nk]` (a 2-D `[B, Nk]` would
    broadcast over queries, not batches). Masks that vary over queries or heads are not key padding.
    """
    if attn_mask.dtype != torch.bool or not 2 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != seq_k:
        return None
    leading = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape[:-1])
    if leading[0] not in (1, batch) or leading[1:] != (1, 1):
        return None
    return attn_mask.reshape(-1, seq_k).expand(batch, seq_k)


def float_key_padding(attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int) -> torch.Tensor | None:
    """An additive float `attn_mask` as a `[B, Nk]` bool key-padding mask (True: attend), or None when it is not one.

    Key padding, as SDPA broadcasts it to `[B, H, Nq, Nk]`: shape `[1, Nk]`, `[1|H, 1, Nk]` or `[1|B, 1|H, 1, Nk]`;
    every value exactly 0 (kept) or <= `DROPPED_AT` (dropped: -inf, finfo.min, LTX's -10000); the same keys kept
    for every head; each batch keeping at least one key (with none kept, finite values weigh all keys alike).
    Anything else (biases, positives, NaN, masks over queries) is not. The values are read: one host sync on
    CUDA (`padding_of` does it once per mask).
    """
    found = _float_kept(attn_mask, batch, heads, seq_k)
    return None if found is None or not found[1].item() else found[0]


def _float_kept(
    attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`float_key_padding`'s `[B, Nk]` kept keys and, as a 0-dim bool tensor not yet read, whether they are
    key padding; None when the mask's shape or dtype already rules it out."""
    if not attn_mask.is_floating_point() or not 2 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != seq_k:
        return None
    leading = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape[:-1])
    if leading[0] not in (1, batch) or leading[1] not in (1, heads) or leading[2] != 1:
        return None
    mask = attn_mask.reshape(leading[0], leading[1], seq_k)
    kept = mask == 0
    valid = (kept | (mask <= DROPPED_AT)).all() & (kept == kept[:, :1]).all() & kept.any(-1).all()
    return kept[:, 0].expand(batch, seq_k), valid
