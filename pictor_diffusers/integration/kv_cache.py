"""FLUX.2-klein's reference-image KV cache (diffusers' `kv_cache_mode`) on pictor's kernels.

diffusers' `Flux2KVAttnProcessor` / `Flux2KVParallelSelfAttnProcessor` serve two modes,
and `PictorAttn` serves them with the same results:

* "extract" (the first step, `num_ref_tokens` > 0): the sequence is
  [text, reference, image]; text and image queries attend to every key, the
  reference queries to the reference keys only, and the post-RoPE reference
  K/V are stored in the layer's cache as `(B, N_ref, H, D)`. Here: one prologue
  and three row windows of one output (`ops.windowed_attention`), no copies.
* "cached" (later steps): the sequence is [text, image] and the keys are
  [text, cached reference, image]. Here: the prologue writes k and v with a gap
  of `N_ref` rows after the text, the cached rows are copied into it, and one
  launch attends with unequal query and key lengths; no concatenation.

The cache holds views `(B, N_ref, H, D)` of head-major `[B, H, N_ref, D]`
tensors in the attention's compute dtype (float32 on the parity path), so a
cached step reads them back without a transpose; caches written by diffusers'
own processors are read too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..cuda.geometry import Window
from ..ops.attention import attention, windowed_attention

MODES = ("extract", "cached")


class KvRequest(NamedTuple):
    """The KV-cache work of one attention call."""

    mode: str
    cache: Any
    text_len: int
    ref_len: int


def kv_request(mode: str | None, cache: Any, text_len: int, ref_len: int) -> KvRequest | None:
    """What diffusers' KV processors would do for these arguments; None means plain attention."""
    if mode is None:
        return None
    if mode not in MODES:
        raise ValueError(f"kv_cache_mode must be one of {MODES} or None, got {mode!r}")
    if mode == "extract" and ref_len > 0:
        return KvRequest(mode, cache, text_len, ref_len)
    if mode == "cached" and cache is not None:
        cached_key, _ = cache.get()
        return KvRequest(mode, cache, text_len, cached_key.shape[1])
    return None


def kv_gap(request: KvRequest | None) -> tuple[int, int]:
    """(row, rows) the prologue leaves free in k and v for the cached reference K/V."""
    if request is None or request.mode != "cached":
        return (0, 0)
    return (request.text_len, request.ref_len)


def kv_attention(
    request: KvRequest, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out_dtype: torch.dtype,
    kernel: str,
) -> torch.Tensor:  # fmt: skip
    """Attention of one KV-mode call on the prologue's head-major q, k, v: token-major `[B, Nq, H*D]`.

    "cached": k and v carry the gap of `kv_gap(request)`, filled here from the cache.
    """
    text, ref = request.text_len, request.ref_len
    rows = slice(text, text + ref)
    if request.mode == "cached":
        cached_key, cached_value = request.cache.get()
        _check_cached(cached_key, cached_value, key, ref)
        key[:, :, rows].copy_(cached_key.transpose(1, 2))
        value[:, :, rows].copy_(cached_value.transpose(1, 2))
        return attention(query, key, value, out_dtype=out_dtype, kernel=kernel)
    if request.cache is not None:
        request.cache.store(key[:, :, rows].clone().transpose(1, 2), value[:, :, rows].clone().transpose(1, 2))
    seq = query.shape[2]
    windows = [Window(0, text, 0, seq), Window(text, text + ref, text, text + ref), Window(text + ref, seq, 0, seq)]
    windows = [w for w in windows if w.q_stop > w.q_start]
    return windowed_attention(query, key, value, windows, out_dtype=out_dtype, kernel=kernel)


_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_cached(cached_key: object, cached_value: object, key: torch.Tensor, ref_len: int) -> None:
    """Raise unless the cached reference K and V are `(B, N_ref, H, D)` tensors of one float dtype on the
    layer's device: a wrong value would otherwise be broadcast into the keys' gap silently."""
    batch, heads, _, head_dim = key.shape
    expected = (batch, ref_len, heads, head_dim)
    for name, tensor in (("keys", cached_key), ("values", cached_value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"the KV cache holds reference {name} of type {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"the KV cache holds reference {name} of shape {tuple(tensor.shape)}; this layer needs "
                f"(B, N_ref, H, D) = {expected}"
            )
        if tensor.device != key.device:
            raise ValueError(f"the KV cache holds reference {name} on {tensor.device}; this layer runs on {key.device}")
        if tensor.dtype not in _CACHE_DTYPES or tensor.dtype != cached_key.dtype:
            raise TypeError(
                f"the KV cache holds reference keys of dtype {cached_key.dtype} and values of dtype "
                f"{tensor.dtype}; they must share one of {_CACHE_DTYPES}"
            )
