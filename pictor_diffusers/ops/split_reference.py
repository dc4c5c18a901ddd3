"""The fp16 split in torch: the twin of `kernels/split_fp16x2.cu` (and so of the split prologue's planes), and
the values the fp16x3 kernel's products see.

`split_twin` makes the planes and column maxima the split kernel makes, in its layout (`geometry.SplitPlanes`)
and with its arithmetic: each group's power-of-two scale from its largest |x|, float32 products (exact),
float16 hi rounded to nearest even and lo the rounded remainder. `joined_twin` turns planes back into
float32 q, k, v, `(hi + lo) 2^-e`, within 2^-22 of each group's largest value: the CPU twin of attention on
split planes runs `reference.twin_attention` on them.
"""

from __future__ import annotations

import torch

from ..cuda.geometry import SplitPlanes

_SPLIT_TOP = 15
"""A group's largest |x| is scaled into [2^14, 2^15) (`PK_SPLIT_TOP`)."""
_SPLIT_MAX_EXP = 120
"""Scale exponents are clamped to +-120 (`PK_SPLIT_MAX_EXP`)."""


def _column_max_bits(groups: torch.Tensor) -> torch.Tensor:
    """`[G, N, D]` float32 -> int32 `[G, D]`: each column's largest |x| as its f32 bit pattern (NaN above inf)."""
    return (groups.view(torch.int32) & 0x7FFFFFFF).amax(dim=1)


def _exponents(max_bits: torch.Tensor) -> torch.Tensor:
    """`pk_split_exponent`: the scale exponent e of groups whose largest |x| has bit pattern `max_bits`;
    0 for an all-zero or non-finite group."""
    largest = max_bits.view(torch.float32)
    _, exponent = torch.frexp(largest)
    e = (_SPLIT_TOP - exponent).clamp(-_SPLIT_MAX_EXP, _SPLIT_MAX_EXP)
    return torch.where((largest == 0) | ~torch.isfinite(largest), 0, e)


def _scales(max_bits: torch.Tensor, per_column: bool, inverse: bool = False) -> torch.Tensor:
    """The float32 scales 2^e (`inverse`: 2^-e) of one tensor's groups from its column maxima `[G, D]`: `[G, D]`
    per column (v) or `[G, 1]` per (batch, head) (q, k); built from their bit patterns (|e| <= 120: normal)."""
    exponents = _exponents(max_bits if per_column else max_bits.amax(dim=1, keepdim=True))
    return (((-exponents if inverse else exponents) + 127) << 23).to(torch.int32).view(torch.float32)


def _split_one(tensor: torch.Tensor, per_column: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One head-major float32 `[B, H, N, D]` tensor -> (hi and lo float16 `[2, B*H, N, D]`, its maxima int32
    `[B*H, D]`); scales per column (v) or per (batch, head) (q, k)."""
    batch, heads, seq, head_dim = tensor.shape
    groups = tensor.reshape(batch * heads, seq, head_dim)
    max_bits = _column_max_bits(groups)
    scaled = groups * _scales(max_bits, per_column)[:, None, :]
    hi = scaled.to(torch.float16)
    lo = (scaled - hi.to(torch.float32)).to(torch.float16)
    return torch.stack((hi, lo)), max_bits


def split_twin(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> SplitPlanes:
    """float32 q, k, v `[B, H, N, D]` as the split kernel splits them (`SplitPlanes`: planes flat float16, q's
    `[2, B*H, N, D]` then k's and v's; maxima int32 `[3, B*H, D]`), bit for bit on inputs it can represent."""
    parts = [_split_one(t.float(), per_column=index == 2) for index, t in enumerate((query, key, value))]
    planes = torch.cat([p.flatten() for p, _ in parts])
    colmax = torch.stack([m for _, m in parts])
    return SplitPlanes(planes, colmax, query.shape[1], query.shape[2])


def joined_twin(split: SplitPlanes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split planes back to float32 q, k, v `[B, H, N, D]`: `(hi + lo) 2^-e` (within 2^-22 of each group's
    largest |x|), the values the fp16x3 kernel's products see."""
    batch, heads, seq, head_dim = split.shape
    planes = split.planes.view(3, 2, batch * heads, seq, head_dim).float()
    joined = [
        ((planes[i, 0] + planes[i, 1]) * _scales(split.colmax[i], i == 2, inverse=True)[:, None, :]).view(
            batch, heads, seq, head_dim
        )
        for i in range(3)
    ]
    return joined[0], joined[1], joined[2]
