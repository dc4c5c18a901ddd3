"""The wgmma kernel's launch as `launch.attention_launch` builds it, on CPU (tensor-map encoding and the device's SM
count stubbed): grid, block size, shared memory and the box rows of the maps of q, k, v and the output, at
head_dim 64 (three consumer warpgroups, 192-row query blocks) and 128 (two, 128 rows), in both builds."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pictor_diffusers.cuda import launch, nvrtc, tensor_maps
from pictor_diffusers.cuda.geometry import full_window
from pictor_diffusers.cuda.plan import AttentionPlan
from pictor_diffusers.cuda.registry import BY_NAME, SHORT_KEYS, variant_for
from pictor_diffusers.cuda.selection import Selection

SMS = 132
BATCH, HEADS, SEQ_Q = 2, 3, 300  # 300 query rows: no multiple of 128 or 192


@pytest.fixture
def boxes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(rows, box rows) of each map the launch asks for, in order: q, k, v, then the output."""
    asked = []

    def map_at(planes: tensor_maps.Planes, head_dim: int, dtype: torch.dtype, box_rows: int = tensor_maps.BOX_ROWS):
        asked.append((planes.rows, box_rows))
        buffer = ctypes.create_string_buffer(128)
        return buffer, ctypes.addressof(buffer)

    monkeypatch.setattr(tensor_maps, "map_at", map_at)
    monkeypatch.setattr(nvrtc, "multiprocessors", lambda device_index: SMS)
    return asked


def wgmma_plan(head_dim: int, seq_k: int) -> AttentionPlan:
    """A plan of the wgmma build `plan.resolve` would pick for bf16 q `[2, 3, 300, head_dim]` over `seq_k` keys."""
    query = torch.zeros(BATCH, HEADS, SEQ_Q, head_dim, dtype=torch.bfloat16)
    key, value = (torch.zeros(BATCH, HEADS, seq_k, head_dim, dtype=torch.bfloat16) for _ in "kv")
    variant = variant_for(BY_NAME["wgmma"], head_dim, "bfloat16", "bfloat16", short_keys=seq_k <= SHORT_KEYS)
    written = torch.zeros(BATCH, SEQ_Q, HEADS * head_dim, dtype=torch.bfloat16)
    window = full_window(query, key)
    selection = Selection(variant, False, ())
    return AttentionPlan(
        selection, 0, 0, query, key, value, written, None, torch.bfloat16, None, None, window, head_dim**-0.5
    )


@pytest.mark.parametrize("seq_k", [SHORT_KEYS, SHORT_KEYS + 77], ids=["persistent", "one-block"])
@pytest.mark.parametrize(("head_dim", "rows", "threads"), [(64, 192, 512), (128, 128, 384)], ids=["D64", "D128"])
def test_wgmma_launch_geometry(head_dim: int, rows: int, threads: int, seq_k: int, boxes: list) -> None:
    """The query map's boxes are a work tile's rows, the key and value maps' a key tile's: 176 keys in the
    head_dim-128 one-block build, else 128."""
    plan = wgmma_plan(head_dim, seq_k)
    variant = plan.selection.variant
    built = launch.attention_launch(plan)
    blocks = -(-SEQ_Q // rows)
    persistent = seq_k <= SHORT_KEYS
    assert variant.persistent == persistent
    assert built.grid == ((min(blocks * HEADS * BATCH, SMS), 1, 1) if persistent else (blocks, HEADS, BATCH))
    assert (built.threads, built.shared_bytes) == (threads, variant.shared_bytes)
    keys = 176 if (head_dim, persistent) == (128, False) else 128
    assert variant.key_rows == keys
    assert boxes == [(SEQ_Q, rows), (seq_k, keys), (seq_k, keys), (SEQ_Q, tensor_maps.STORE_BOX_ROWS)]
    assert tensor_maps.STORE_BOX_ROWS == 64, "the output box is one consumer warpgroup's rows"
