"""Ring and unified ring x Ulysses context parallelism are refused, never silently wrong.

diffusers' `enable_parallelism` shards the sequence across ranks and records
its config on every attention processor. PictorAttn serves Ulysses
(tests/test_context_parallel.py); ring attention merges per-shard results by
their log-sum-exp, which pictor's kernels do not return, so ring configs must
raise, naming the degrees and the served mode, instead of attending within each
rank's shard. Run as a user would, on CPU: 2 ranks over gloo, ring 2; the
unified config (4 ranks) is checked on the processor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import build_transformer, transformer_inputs

SERVED = "serves Ulysses context parallelism only"


def _rank(rank: int, init_file: str, results: dict) -> None:
    from diffusers import ContextParallelConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on CPU
    try:
        model = build_transformer()
        model.set_attn_processor(PictorAttn())
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=2))
        inputs = transformer_inputs(model, batch=1, latent_hw=(4, 4), text_len=6)
        for name in ("img_ids", "txt_ids"):
            inputs[name] = inputs[name][None]  # 3-D, as FLUX.2 pipelines pass them: diffusers splits them
        with torch.no_grad():
            model(**inputs)
        results[rank] = "no error"
    except NotImplementedError as error:
        results[rank] = str(error)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ring_attention_is_refused(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "init"), results), nprocs=2)
        outcome = dict(results)
    for rank in (0, 1):
        assert SERVED in outcome[rank], outcome
        assert "ulysses_degree=1, ring_degree=2" in outcome[rank], outcome


@pytest.mark.parametrize(("ulysses", "ring"), [(1, 2), (2, 2)], ids=["ring", "unified"])
def test_a_ring_config_on_the_processor_is_refused(ulysses: int, ring: int) -> None:
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention

    module = Flux2ParallelSelfAttention(query_dim=64, heads=2, dim_head=32, out_dim=64, mlp_ratio=3.0)
    processor = PictorAttn()
    context = ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring)
    processor._parallel_config = ParallelConfig(context_parallel_config=context)
    with pytest.raises(NotImplementedError, match=rf"{SERVED}.*ulysses_degree={ulysses}, ring_degree={ring}"):
        processor(module, torch.randn(1, 7, 64))


def test_an_unset_ulysses_config_is_refused() -> None:
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention

    module = Flux2ParallelSelfAttention(query_dim=64, heads=2, dim_head=32, out_dim=64, mlp_ratio=3.0)
    processor = PictorAttn()
    processor._parallel_config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=2))
    with pytest.raises(RuntimeError, match=r"ulysses_degree=2\) without a device mesh.*enable_parallelism"):
        processor(module, torch.randn(1, 7, 64))
