"""diffusers' float attention masks over keys as `attention`'s `key_bias`: served without reading the mask.

A float `attn_mask` that is the same for every query row (`[B|1, H|1, 1, Nk]` as SDPA broadcasts it, e.g.
LTX-Video's text mask of 0 and -10000, repeated per head) is a bias per key: the Hopper 16-bit kernel adds it
to the logits itself (kernels/key_bias.cuh) and the CPU twins do the same, so such a call needs no host sync,
no gather and no check of the values, eagerly, under torch.compile and in CUDA graph capture alike. Elsewhere
(other GPUs, the 8-bit kernels) the mask goes to `key_padding.padding_of`.
"""

from __future__ import annotations

import torch

from ..cuda.plan import resolve
from ..cuda.registry import KERNELS
from ..cuda.selection import NoKernelError
from ..dtypes import DTYPE_NAMES, DTYPES


def key_bias_of(attn_mask: torch.Tensor, batch: int, heads: int, seq_k: int) -> torch.Tensor | None:
    """`attn_mask` as a `[B, 1 or H, Nk]` key bias (a view, values unread), or None when it is not one: not
    floating point, or, broadcast as SDPA does to `[B, H, Nq, Nk]`, not the same for every query row."""
    if not attn_mask.is_floating_point() or not 1 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != seq_k:
        return None
    leading = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape[:-1])
    if leading[0] not in (1, batch) or leading[1] not in (1, heads) or leading[2] != 1:
        return None
    return attn_mask.reshape(leading[0], leading[1], seq_k).expand(batch, leading[1], seq_k)


def takes_key_bias(kernel: str, compute: torch.dtype, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the call on the dispatcher's q, k, v `[B, N, H, D]` (`tensors`), run by `kernel` in `compute`,
    can take a key bias: pictor's 16-bit path ("auto") on CPU (the twins), or on a CUDA device where its kernel
    has key-bias builds (`plan.resolve`; rows that are not 16-byte aligned are copied, `plan_attention`). The
    CUDA answer is a constant of the device and head_dim, taken once while tracing under torch.compile."""
    query = tensors[0]
    if kernel != "auto" or query.device.type not in ("cpu", "cuda"):
        return False
    if query.device.type == "cpu":
        return True
    head_dim = next((d for d in _BIAS_HEAD_DIMS if query.shape[-1] == d), None)  # a constant, even if traced
    return head_dim is not None and _has_key_bias_builds(DTYPE_NAMES[compute], head_dim, query.device.index or 0)


_BIAS_HEAD_DIMS = tuple(sorted({d for spec in KERNELS if spec.key_bias_bytes is not None for d in spec.head_dims}))
"""The head_dims of the kernels with key-bias builds."""


@torch.compiler.assume_constant_result
def _has_key_bias_builds(compute: str, head_dim: int, device_index: int) -> bool:
    """Whether "auto" runs `compute` q, k, v of `head_dim` with a key bias on CUDA device `device_index`, over
    short and long key sequences alike (loading both builds, memoised by `resolve`); a constant under
    torch.compile."""
    dtype = DTYPES[compute]
    try:
        prepared = [
            resolve("auto", dtype, dtype, head_dim, device_index, True, short_keys=short, key_bias=True)
            for short in (False, True)
        ]
    except NoKernelError:
        return False
    return all(p.selection.variant is not None for p in prepared)
