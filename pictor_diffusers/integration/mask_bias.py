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
    has a key-bias build (`plan.resolve`). Under torch.compile the answer is a constant of the device, taken
    once while tracing, for 16-byte-aligned rows (the op's call copies rows that are not, `plan_attention`)."""
    query = tensors[0]
    if kernel != "auto" or query.device.type not in ("cpu", "cuda"):
        return False
    if query.device.type == "cpu":
        return True
    in_place = query.dtype == compute  # else each tensor is cast into a new, aligned one
    compiling = torch.compiler.is_compiling()
    aligned = compiling or not in_place or not any(t.data_ptr() % 16 for t in tensors)
    return _has_key_bias_build(DTYPE_NAMES[compute], query.shape[-1], query.device.index or 0, aligned)


@torch.compiler.assume_constant_result
def _has_key_bias_build(compute: str, head_dim: int, device_index: int, aligned: bool) -> bool:
    """Whether "auto" runs `compute` q, k, v of `head_dim` with a key bias on CUDA device `device_index`
    (loading the build, memoised by `resolve`); a constant under torch.compile."""
    dtype = DTYPES[compute]
    try:
        prepared = resolve("auto", dtype, dtype, head_dim, device_index, aligned, key_bias=True)
    except NoKernelError:
        return False
    return prepared.selection.variant is not None
