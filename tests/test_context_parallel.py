"""Ulysses context parallelism through PictorAttn, on CPU: P ranks over gloo against one process.

Each rank builds the same seeded tiny model, `enable_parallelism(ContextParallelConfig(ulysses_degree=P))`
shards the text and image tokens (and their ids, hence RoPE), and one forward runs; rank 0's gathered
output is compared with a single-process forward of the same model and inputs.

* float32 (FLUX.2 b1, b2 with fused projections, uneven shards with `ulysses_anything`, FLUX.1): max
  relative error (max-abs / max |reference|) <= 1e-5. Measured 1.1e-7..2.4e-7 at 2 and 4 ranks, as stock
  diffusers' Ulysses shows (1.4e-7): f32 reassociation (projections of fewer rows, another key order).
* bfloat16 model, `PictorAttn(precision="bf16")`: its distance to its own single process must be within
  max(2 x the distance stock Ulysses (native SDPA) shows from stock single process, one bf16 ulp).
  Measured: PictorAttn 0 at 2 and 4 ranks; stock 2.4e-3 at 2 ranks, 0 at 4.
* Refused, on every rank, before any collective: heads not divisible by P, RoPE not split (2-D FLUX.2 ids).
  A backward still raises "inference-only".

Token counts per rank are odd and uneven mixes: 2 ranks 18 image + 10 text tokens (9 + 5 a rank), 4 ranks
28 + 12 (7 + 3); the uneven case has one text token less (2 ranks: 14 and 13 tokens). Its image tokens stay
divisible by P because diffusers gathers uneven outputs with an all_gather that gloo does not serve.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import (
    TINY_CONFIG,
    build_flux1_transformer,
    build_transformer,
    flux1_transformer_inputs,
    transformer_inputs,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

TINY_FLUX1 = {
    "patch_size": 1,
    "in_channels": 8,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 24,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (8, 8, 16),
}
SHAPES = {2: ((3, 6), 10), 4: ((7, 4), 12)}
"""Ulysses degree -> (latent (height, width), text tokens)."""


class Case(NamedTuple):
    model: str = "flux2"
    precision: str | None = "fp32"  # None: diffusers' stock processors
    dtype: torch.dtype = torch.float32
    batch: int = 1
    fused: bool = False
    uneven: bool = False  # ulysses_anything, one text token less
    heads: int = 4
    ids_2d: bool = False
    backward: bool = False


CASES = {
    "fp32": Case(),
    "fp32-b2-fused": Case(batch=2, fused=True),
    "fp32-uneven": Case(uneven=True),
    "flux1-fp32": Case(model="flux1"),
    "fp32-stock": Case(precision=None),
    "bf16": Case(precision="bf16", dtype=torch.bfloat16),
    "bf16-stock": Case(precision=None, dtype=torch.bfloat16),
    "heads-3": Case(heads=3),
    "ids-2d": Case(ids_2d=True),
    "backward": Case(backward=True),
}
FP32_CASES = ["fp32", "fp32-b2-fused", "fp32-uneven", "flux1-fp32"]
FP32_MAX_REL = 1e-5
BF16_FACTOR = 2.0
BF16_FLOOR = 2.0**-8


def build(case: Case) -> torch.nn.Module:
    """The seeded model of `case`, its processors set."""
    if case.model == "flux1":
        model = build_flux1_transformer({**TINY_FLUX1, "num_attention_heads": case.heads})
    else:
        model = build_transformer({**TINY_CONFIG, "num_attention_heads": case.heads})
    if case.fused:
        model.fuse_qkv_projections()
    model = model.to(case.dtype)
    if case.precision is not None:
        model.set_attn_processor(PictorAttn(precision=case.precision))
    return model


def case_inputs(model: torch.nn.Module, case: Case, degree: int) -> dict:
    """Seeded inputs; FLUX.2 ids 3-D `[B, N, 4]` as its pipelines pass them (diffusers' cp plan splits those)."""
    latent_hw, text_len = SHAPES[degree]
    text_len -= case.uneven
    if case.model == "flux1":
        return flux1_transformer_inputs(model, case.batch, latent_hw, text_len)
    inputs = transformer_inputs(model, case.batch, latent_hw, text_len)
    if not case.ids_2d:
        for name in ("img_ids", "txt_ids"):
            inputs[name] = inputs[name][None].expand(case.batch, -1, -1)
    return inputs


def _run_case(case: Case, degree: int) -> torch.Tensor | str:
    """One Ulysses forward (and backward where asked): the gathered output, or the refusal's message."""
    from diffusers import ContextParallelConfig

    model = build(case)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, ulysses_anything=case.uneven))
    inputs = case_inputs(model, case, degree)
    try:
        with torch.set_grad_enabled(case.backward):
            out = model(**inputs)[0]
            if case.backward:
                out.sum().backward()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return out.detach().clone()


def _rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on CPU
    try:
        for name, case in CASES.items():
            result = _run_case(case, world)
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{name}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=["ulysses2", "ulysses4"])
def parallel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """(P, {case: rank 0's output or refusal message}) from one spawn of P ranks running every case."""
    world = request.param
    folder = tmp_path_factory.mktemp(f"ulysses{world}")
    mp.spawn(_rank, args=(world, str(folder / "init"), str(folder)), nprocs=world)
    return world, {name: torch.load(folder / f"{name}.pt") for name in CASES}


def single_process(name: str, degree: int) -> torch.Tensor:
    case = CASES[name]
    model = build(case)
    with torch.no_grad():
        return model(**case_inputs(model, case, degree))[0]


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def served(results: dict, name: str) -> torch.Tensor:
    result = results[name]
    assert isinstance(result, torch.Tensor), f"{name} was refused: {result}"
    assert torch.isfinite(result).all(), f"{name}: NaN/Inf in the output"
    return result


@pytest.mark.parametrize("name", FP32_CASES)
def test_float32_matches_one_process(parallel: tuple[int, dict], name: str) -> None:
    degree, results = parallel
    out, reference = served(results, name), single_process(name, degree)
    assert out.shape == reference.shape and out.dtype == reference.dtype
    error = max_rel(out, reference)
    stock = max_rel(served(results, "fp32-stock"), single_process("fp32-stock", degree))
    print(f"ulysses_degree={degree} {name}: max rel {error:.2e} (stock Ulysses fp32: {stock:.2e})")
    assert error <= FP32_MAX_REL, f"{name}: max relative error {error:.3e} > {FP32_MAX_REL}"


def test_bf16_within_stock_ulysses_error(parallel: tuple[int, dict]) -> None:
    degree, results = parallel
    ours = max_rel(served(results, "bf16"), single_process("bf16", degree))
    stock = max_rel(served(results, "bf16-stock"), single_process("bf16-stock", degree))
    print(f"ulysses_degree={degree} bf16: PictorAttn max rel {ours:.2e}, stock Ulysses {stock:.2e}")
    bound = max(BF16_FACTOR * stock, BF16_FLOOR)
    assert served(results, "bf16").dtype == torch.bfloat16
    assert ours <= bound, f"PictorAttn bf16 Ulysses max rel {ours:.3e} > {bound:.3e} (stock {stock:.3e})"


def test_refusals_name_the_values(parallel: tuple[int, dict]) -> None:
    degree, results = parallel
    heads = results["heads-3"]
    assert heads.startswith("ValueError") and f"3 attention heads across ulysses_degree={degree}" in heads, heads
    rope = results["ids-2d"]
    assert rope.startswith("ValueError") and "RoPE tables have" in rope and "3-D [B, N, 4]" in rope, rope
    backward = results["backward"]
    assert backward.startswith("NotImplementedError") and "inference-only" in backward, backward
