"""Context parallelism through PictorAttn, on CPU: P ranks over gloo against one process.

Modes: Ulysses 2, ring 2, Ulysses 4, and unified ring 2 x Ulysses 2 on 4 ranks. Each rank builds the
same seeded tiny model, `enable_parallelism(ContextParallelConfig(...))` shards the text and image tokens
(and their ids, hence RoPE), and one forward runs; rank 0's gathered output is compared with a
single-process forward of the same model and inputs.

* float32 (FLUX.2 b1, b2 with fused projections, uneven shards with `ulysses_anything` /
  `ring_anything`, FLUX.1): max relative error (max-abs / max |reference|) <= 1e-5, the issue's target.
  Stock diffusers' own context parallelism shows 1e-7-scale distances (f32 reassociation: projections
  of fewer rows, another key order, the log-sum-exp merge of ring shards); each case prints both.
* bfloat16 model, `PictorAttn(precision="bf16")`: its distance to its own single process must be within
  max(2 x the distance stock context parallelism (native SDPA) shows from stock single process, one
  bf16 ulp). Stock ring attention cannot run on CPU (it needs a log-sum-exp, which none of diffusers'
  CPU backends returns); there the bound is one bf16 ulp.
* The 8-bit path (`PictorAttn(precision="fp8")`, its CPU twin, on a head_dim-128 variant of the model: the
  kernel's only head_dim) within 3x its own distance from bf16 (each ring shard quantises its own keys).
* Refused, on every rank, before any collective: heads not divisible by the Ulysses degree, RoPE not
  split (2-D FLUX.2 ids). A backward still raises "inference-only".

Token counts per rank are odd and uneven mixes: 2 ranks 18 image + 10 text tokens (9 + 5 a rank), 4 ranks
28 + 12 (7 + 3); the uneven case has one text token less (2 ranks: 14 and 13 tokens; diffusers allows it
for Ulysses or ring alone, not unified). Its image tokens stay divisible by P because diffusers gathers
uneven outputs with an all_gather that gloo does not serve.
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
    TINY_FLUX1_CONFIG,
    build_flux1_transformer,
    build_transformer,
    flux1_transformer_inputs,
    transformer_inputs,
)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

SHAPES = {2: ((3, 6), 10), 4: ((7, 4), 12)}
"""World size -> (latent (height, width), text tokens)."""


class Mode(NamedTuple):
    name: str
    ulysses: int
    ring: int

    @property
    def world(self) -> int:
        return self.ulysses * self.ring


MODES = [Mode("ulysses2", 2, 1), Mode("ring2", 1, 2), Mode("ulysses4", 4, 1), Mode("unified2x2", 2, 2)]


class Case(NamedTuple):
    model: str = "flux2"
    precision: str | None = "fp32"  # None: diffusers' stock processors
    dtype: torch.dtype = torch.float32
    batch: int = 1
    fused: bool = False
    uneven: bool = False  # ulysses_anything or ring_anything, one text token less
    heads: int = 4
    head_dim: int = 32
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
    "fp8": Case(precision="fp8", dtype=torch.bfloat16, head_dim=128),  # the 8-bit kernel's only head_dim
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
        model = build_flux1_transformer({**TINY_FLUX1_CONFIG, "num_attention_heads": case.heads})
    else:
        rope = {"axes_dims_rope": (case.head_dim // 4,) * 4}  # FLUX.2's four RoPE axes
        model = build_transformer(
            {**TINY_CONFIG, "num_attention_heads": case.heads, "attention_head_dim": case.head_dim, **rope}
        )
    if case.fused:
        model.fuse_qkv_projections()
    model = model.to(case.dtype)
    if case.precision is not None:
        model.set_attn_processor(PictorAttn(precision=case.precision))
    return model


def case_inputs(model: torch.nn.Module, case: Case, world: int) -> dict:
    """Seeded inputs; FLUX.2 ids 3-D `[B, N, 4]` as its pipelines pass them (diffusers' cp plan splits those)."""
    latent_hw, text_len = SHAPES[world]
    text_len -= case.uneven
    if case.model == "flux1":
        return flux1_transformer_inputs(model, case.batch, latent_hw, text_len)
    inputs = transformer_inputs(model, case.batch, latent_hw, text_len)
    if not case.ids_2d:
        for name in ("img_ids", "txt_ids"):
            inputs[name] = inputs[name][None].expand(case.batch, -1, -1)
    return inputs


def _run_case(case: Case, mode: Mode) -> torch.Tensor | str | None:
    """One parallel forward (and backward where asked): the gathered output, the refusal's message, or
    None where diffusers cannot run it: uneven shards under unified attention, and stock ring attention on
    CPU (it needs a log-sum-exp, which none of diffusers' CPU backends returns)."""
    from diffusers import ContextParallelConfig

    if (case.uneven and mode.ulysses > 1 and mode.ring > 1) or (case.precision is None and mode.ring > 1):
        return None
    uneven = {"ulysses_anything": case.uneven} if mode.ring == 1 else {"ring_anything": case.uneven}
    config = ContextParallelConfig(ulysses_degree=mode.ulysses, ring_degree=mode.ring, **uneven)
    model = build(case)
    model.enable_parallelism(config=config)
    inputs = case_inputs(model, case, mode.world)
    try:
        with torch.set_grad_enabled(case.backward):
            out = model(**inputs)[0]
            if case.backward:
                out.sum().backward()
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return out.detach().clone()


def _rank(rank: int, mode: Mode, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=mode.world, timeout=timedelta(seconds=60)
    )
    torch.accelerator.device_count = lambda: 1  # diffusers divides by it; 0 on CPU
    try:
        for name, case in CASES.items():
            result = _run_case(case, mode)
            if rank == 0:
                torch.save(result, Path(out_dir) / f"{name}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=MODES, ids=[mode.name for mode in MODES])
def parallel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Mode, dict]:
    """(mode, {case: rank 0's output, refusal message or None}) from one spawn of the mode's ranks."""
    mode = request.param
    folder = tmp_path_factory.mktemp(mode.name)
    mp.spawn(_rank, args=(mode, str(folder / "init"), str(folder)), nprocs=mode.world)
    return mode, {name: torch.load(folder / f"{name}.pt") for name in CASES}


def single_process(name: str, world: int, case: Case | None = None) -> torch.Tensor:
    """The single-process output of `CASES[name]` (or of `case`, where given) on `world`'s inputs."""
    case = case or CASES[name]
    model = build(case)
    with torch.no_grad():
        return model(**case_inputs(model, case, world))[0]


def max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def stock_distance(results: dict, name: str, mode: Mode) -> float | None:
    """Stock context parallelism's max rel distance from stock single process; None where it cannot run."""
    if results[name] is None:
        return None
    return max_rel(served(results, name), single_process(name, mode.world))


def shown(distance: float | None) -> str:
    return "n/a on CPU" if distance is None else f"{distance:.2e}"


def served(results: dict, name: str) -> torch.Tensor:
    result = results[name]
    assert isinstance(result, torch.Tensor), f"{name} was refused: {result}"
    assert torch.isfinite(result).all(), f"{name}: NaN/Inf in the output"
    return result


@pytest.mark.parametrize("name", FP32_CASES)
def test_float32_matches_one_process(parallel: tuple[Mode, dict], name: str) -> None:
    mode, results = parallel
    if results[name] is None:
        pytest.skip(f"diffusers has no {name} config under {mode.name}")
    out, reference = served(results, name), single_process(name, mode.world)
    assert out.shape == reference.shape and out.dtype == reference.dtype
    error = max_rel(out, reference)
    print(f"{mode.name} {name}: max rel {error:.2e} (stock fp32: {shown(stock_distance(results, 'fp32-stock', mode))})")
    assert error <= FP32_MAX_REL, f"{name}: max relative error {error:.3e} > {FP32_MAX_REL}"


def test_bf16_within_stock_error(parallel: tuple[Mode, dict]) -> None:
    mode, results = parallel
    ours = max_rel(served(results, "bf16"), single_process("bf16", mode.world))
    stock = stock_distance(results, "bf16-stock", mode)
    print(f"{mode.name} bf16: PictorAttn max rel {ours:.2e}, stock {shown(stock)}")
    bound = BF16_FLOOR if stock is None else max(BF16_FACTOR * stock, BF16_FLOOR)
    assert served(results, "bf16").dtype == torch.bfloat16
    assert ours <= bound, f"PictorAttn bf16 {mode.name} max rel {ours:.3e} > {bound:.3e} (stock {stock:.3e})"


def test_fp8_within_its_own_quantisation_error(parallel: tuple[Mode, dict]) -> None:
    """The 8-bit path (its CPU twin here) quantises each rank's key block on its own under ring attention, so
    it may differ from one process by its own quantisation noise (two independent draws of it: about 2x
    fp8's distance from bf16, measured 2.0x under ring2 and 1.0x under unified2x2): bound by 3x. The tiny
    model's keys have small mean offsets; the LSE merge across shards of different means is checked by
    `test_quant_reference.py::test_twin_lse_merges_key_shards`."""
    mode, results = parallel
    alone = single_process("fp8", mode.world)
    ours = max_rel(served(results, "fp8"), alone)
    noise = max_rel(alone, single_process("bf16", mode.world, CASES["fp8"]._replace(precision="bf16")))
    print(f"{mode.name} fp8: max rel {ours:.2e} from one process (fp8 vs bf16 in one process: {noise:.2e})")
    assert served(results, "fp8").dtype == torch.bfloat16
    assert ours <= max(3.0 * noise, BF16_FLOOR), f"fp8 {mode.name} max rel {ours:.3e} > 3 x {noise:.3e}"


def test_ring_alone_serves_any_head_count(parallel: tuple[Mode, dict]) -> None:
    mode, results = parallel
    if mode.ulysses > 1:
        pytest.skip("Ulysses splits heads: refused, see test_refusals_name_the_values")
    error = max_rel(served(results, "heads-3"), single_process("heads-3", mode.world))
    assert error <= FP32_MAX_REL, f"3 heads under {mode.name}: max relative error {error:.3e}"


def test_refusals_name_the_values(parallel: tuple[Mode, dict]) -> None:
    mode, results = parallel
    heads = results["heads-3"]
    if mode.ulysses > 1:
        expected = f"3 attention heads across ulysses_degree={mode.ulysses}"
        assert isinstance(heads, str) and heads.startswith("ValueError") and expected in heads, heads
    rope = results["ids-2d"]
    assert rope.startswith("ValueError") and "RoPE tables have" in rope and "3-D [B, N, 4]" in rope, rope
    backward = results["backward"]
    assert backward.startswith("NotImplementedError") and "inference-only" in backward, backward
