"""Tile shapes and shared-memory sizes of the attention kernels' builds: how many query rows, key rows and K/V stages a
build takes at each head_dim, the block it launches as (`BlockShape`), and the bytes of shared memory that follow.
The registry's rows (`registry.py`) name these; the kernels `static_assert` the same formulas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class BlockShape:
    """How a row's builds at one head_dim are launched (`KernelSpec.shape`): block size, query rows per block
    (a work tile), and the `-D` geometry of both builds and what the persistent build changes of it."""

    threads: int
    rows_per_block: int
    geometry: Mapping[str, str]
    persistent_geometry: Mapping[str, str] = field(default_factory=dict)


def fp8_smem(d: int) -> int:
    """Q, four stages of K and V^T (128 x 128 one-byte codes each), 8 x 128 ones for the row sums, mbarriers."""
    return 1024 + (1 + 2 * 4) * 128 * d + 8 * 128 + 8 * (1 + 4 * 4)


class _Ring(NamedTuple):
    """A wgmma build's K/V ring: keys per key tile (the K/V tiles' rows and their maps' box rows) and stages."""

    keys: int
    stages: int


_WGMMA_TILES = {128: (128, _Ring(176, 2), _Ring(128, 2)), 64: (192, _Ring(128, 4), _Ring(128, 3))}
"""The wgmma row's tiling by head_dim: (query rows per block, the one-block build's K/V ring, the persistent
build's). At 128 the one-block build (long key sequences) takes 176-key tiles, as FlashAttention-3 tiles head_dim
128: 27% fewer key tiles, so 27% fewer of each tile's fixed costs (mbarrier waits, the O rescale, the row max
and sum shuffles, wgmma fences and commits); two stages of them fill the shared memory (three do not fit), and
beside the persistent build's Q, next Q and output tiles two stages of 176 keys do not fit (279,648 bytes).
At 64 a key tile's exponentials cost the SM as much time as its products, so three consumer warpgroups (192 rows, as
FlashAttention-3 tiles head_dim 64) are to keep the tensor cores busy through one another's softmax; their 160
registers a thread hold a 128-key tile's scores, not a 176-key one's."""


def wgmma_shape(d: int) -> BlockShape:
    """The wgmma row's launch at head_dim `d`: a producer warpgroup and one consumer warpgroup per 64 query rows,
    each build's key tiles and stages."""
    rows, ring, persistent_ring = _WGMMA_TILES[d]
    threads = 128 * (1 + rows // 64)
    geometry = {"BQ": str(rows), "BK": str(ring.keys), "STAGES": str(ring.stages), "THREADS": str(threads)}
    persistent = {"BK": str(persistent_ring.keys), "STAGES": str(persistent_ring.stages)}
    return BlockShape(threads, rows, geometry, persistent)


def wgmma_smem(d: int, persistent: bool = False) -> int:
    """Alignment slack, the Q tile (the persistent build: two, and an output staging tile; rows per block x d
    16-bit each), the stages of K and V (keys per tile x d), mbarriers."""
    rows, ring, persistent_ring = _WGMMA_TILES[d]
    q_tiles, ring = (3, persistent_ring) if persistent else (1, ring)
    return 1024 + q_tiles * rows * d * 2 + 2 * ring.stages * ring.keys * d * 2 + 8 * (4 + 4 * ring.stages)


def wgmma_bias_bytes(d: int, persistent: bool = False) -> int:
    """What a build's key-bias flavour adds (`WG_KEY_BIAS=1`): a row of f32 biases per K/V stage of its ring,
    each padded to 128 bytes (a tensor copy's shared-memory alignment)."""
    _, ring, persistent_ring = _WGMMA_TILES[d]
    ring = persistent_ring if persistent else ring
    return ring.stages * -(-ring.keys * 4 // 128) * 128


def fp16x3_smem(d: int) -> int:
    """Q hi + lo (128 rows), two stages of K and V hi + lo (64 rows), mbarriers."""
    return 1024 + 2 * 128 * d * 2 + 2 * 4 * 64 * d * 2 + 8 * (1 + 4 * 2)
