"""Context parallelism is refused, never silently wrong.

diffusers' `enable_parallelism` shards the sequence across ranks and records
its config on every attention processor; PictorAttn does not serve it yet and
must raise, naming the degrees, instead of attending within each rank's shard.
Run as a user would, on CPU: 2 ranks over gloo, Ulysses 2 and ring 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import build_transformer, transformer_inputs

MODES = {"ulysses": {"ulysses_degree": 2}, "ring": {"ring_degree": 2}}


def _rank(rank: int, init_file: str, mode: str, results: dict) -> None:
    from diffusers import ContextParallelConfig

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on CPU
    try:
        model = build_transformer()
        model.set_attn_processor(PictorAttn())
        model.enable_parallelism(config=ContextParallelConfig(**MODES[mode]))
        inputs = transformer_inputs(model, batch=1, latent_hw=(4, 4), text_len=6)
        with torch.no_grad():
            model(**inputs)
        results[rank] = "no error"
    except NotImplementedError as error:
        results[rank] = str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("mode", list(MODES))
def test_context_parallelism_is_refused(mode: str, tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "init"), mode, results), nprocs=2)
        outcome = dict(results)
    degree = next(iter(MODES[mode].items()))
    for rank in (0, 1):
        assert "does not serve diffusers context parallelism" in outcome[rank], outcome
        assert f"{degree[0]}={degree[1]}" in outcome[rank], outcome


def test_a_parallel_config_on_the_processor_is_refused() -> None:
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention

    module = Flux2ParallelSelfAttention(query_dim=64, heads=2, dim_head=32, out_dim=64, mlp_ratio=3.0)
    processor = PictorAttn()
    processor._parallel_config = ParallelConfig(context_parallel_config=ContextParallelConfig(ring_degree=2))
    with pytest.raises(NotImplementedError, match=r"ulysses_degree=1, ring_degree=2"):
        processor(module, torch.randn(1, 7, 64))
