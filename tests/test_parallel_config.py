"""What PictorAttn does with a context-parallel config before any collective runs.

Served modes (Ulysses, ring, unified) are tested end to end in tests/test_context_parallel.py. Here,
on the processor alone: a config that `enable_parallelism` has not set up (no device mesh) and the
KV-cache modes under context parallelism raise, naming the values, instead of attending within one
rank's shard.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pictor_diffusers import PictorAttn

DEGREES = [(2, 1), (1, 2), (2, 2)]
IDS = ["ulysses", "ring", "unified"]


def _module() -> torch.nn.Module:
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention

    return Flux2ParallelSelfAttention(query_dim=64, heads=2, dim_head=32, out_dim=64, mlp_ratio=3.0)


def _processor(ulysses: int, ring: int, meshes: bool) -> PictorAttn:
    from diffusers import ContextParallelConfig, ParallelConfig

    context = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    if meshes:
        context._ulysses_mesh = context._ring_mesh = SimpleNamespace(get_group=lambda: None)
    processor = PictorAttn()
    processor._parallel_config = ParallelConfig(context_parallel_config=context)
    return processor


@pytest.mark.parametrize(("ulysses", "ring"), DEGREES, ids=IDS)
def test_a_config_without_a_mesh_is_refused(ulysses: int, ring: int) -> None:
    name, degree = ("ulysses", ulysses) if ulysses > 1 else ("ring", ring)
    with pytest.raises(RuntimeError, match=rf"{name}_degree={degree}\) without a device mesh.*enable_parallelism"):
        _processor(ulysses, ring, meshes=False)(_module(), torch.randn(1, 7, 64))


@pytest.mark.parametrize(("ulysses", "ring"), DEGREES, ids=IDS)
@pytest.mark.parametrize("mode", ["extract", "cached"])
def test_kv_cache_modes_under_context_parallelism_are_refused(ulysses: int, ring: int, mode: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"kv_cache_mode='{mode}' under context parallelism"):
        _processor(ulysses, ring, meshes=True)(_module(), torch.randn(1, 7, 64), kv_cache_mode=mode)
