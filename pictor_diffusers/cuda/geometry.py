"""What one kernel launch covers: its row window, and the plain facts the operand builders need.

`Window`: query rows [q_start, q_stop) over keys [k_start, k_stop) of `[B, H, N, D]` inputs.
`Geometry`: planes (B*H), the window's row counts, the full tensors' pitches, head_dim, dtype, heads and the
logit scale times log2 e, for the prepasses (`launch.split_planes`, `quantized.quantize`).
`Launch`: one attention kernel's launch with its arguments built (`launch.attention_launch`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


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
