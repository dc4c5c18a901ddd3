"""What one kernel launch covers: its row window, and the plain facts the operand builders need.

`Window`: query rows [q_start, q_stop) over keys [k_start, k_stop) of `[B, H, N, D]` inputs.
`Geometry`: planes (B*H), the window's row counts, the full tensors' pitches, head_dim, dtype, heads and the
logit scale times log2 e, for the prepasses (`launch.split_planes`, `quantized.quantize`).
`Launch`: one attention kernel's launch with its arguments built (`launch.attention_launch`).
`SplitPlanes`: q, k, v already split into the fp16x3 kernel's operands (by the split prologue), and
`split_halves`, the size of such planes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

LOG2_E = 1.0 / math.log(2.0)
"""log2(e): the kernels' softmax runs in the exp2 domain, so logit scales and key biases are taken times it."""


class Window(NamedTuple):
    """The rows one launch computes: query rows [q_start, q_stop) over keys [k_start, k_stop)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int


def full_window(query: torch.Tensor, key: torch.Tensor) -> Window:
    """Every query row over every key."""
    return Window(0, query.shape[2], 0, key.shape[2])


class Geometry(NamedTuple):
    """What the operand builders need of a launch: planes (B*H), window rows, pitches, head_dim, dtype,
    heads (H) and the logit scale times log2 e."""

    planes: int
    q_count: int
    k_count: int
    q_pitch: int
    kv_pitch: int
    head_dim: int
    dtype: torch.dtype
    heads: int
    scale_log2: float


class Launch(NamedTuple):
    """One attention kernel's launch, arguments built: the device, grid, block size, dynamic shared memory, the
    ctypes signature and the argument values (operands, then scalars; the operand at `OUT_OPERAND` is the
    output's address), and what must stay referenced until the launch is issued (tensor maps, workspaces)."""

    device_index: int
    grid: tuple[int, int, int]
    threads: int
    shared_bytes: int
    signature: tuple[Any, ...]
    args: tuple[Any, ...]
    keep: object


OUT_OPERAND = 3
"""Every operand kind lists q, k, v (pointers or maps), then the output's address."""
OUT_MAP_OPERAND = 6
"""The "tensor_maps" kind's kernel (wgmma) stores through a map of its output, after the key counts."""


def split_halves(planes: int, q_rows: int, k_rows: int, head_dim: int) -> int:
    """float16 elements of the split planes of `planes` (B*H) groups: hi and lo of q's `q_rows` and of k's
    and v's `k_rows` rows each."""
    return 2 * planes * (q_rows + 2 * k_rows) * head_dim


class SplitPlanes(NamedTuple):
    """q, k, v of `seq` rows each as the split-planes kernel (fp16x3) reads them.

    `planes`: float16, flat: q's `[2 (hi, lo), B*H, seq, D]`, then k's and v's alike (`split_halves`
    elements), each value x as x 2^e = hi + lo. `colmax`: int32 `[3, B*H, D]`, the largest |x| of each
    column of q, k and v per (batch, head) as f32 bit patterns, which give the power-of-two scales 2^e (q,
    k: one per (batch, head); v: one per column). `heads`: H.
    """

    planes: torch.Tensor
    colmax: torch.Tensor
    heads: int
    seq: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """q's, k's and v's `[B, H, seq, D]`."""
        _, groups, head_dim = self.colmax.shape
        return groups // self.heads, self.heads, self.seq, head_dim
