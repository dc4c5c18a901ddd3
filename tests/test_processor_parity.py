"""Whole-model parity: tiny random FLUX.2 transformers, stock processors vs `PictorAttn`.

* float32: relative L2 error of the output <= 1e-5. Measured 5.2e-8..1.1e-7
  (max-abs 2.4e-7..4.8e-7 on outputs of magnitude ~2): f32 reassociation only.
* bfloat16 / float16: the "within the low precision's own error" contract.
  Both the stock and the PictorAttn low-precision models are compared to the
  float32 model they were cast from (stock processors); PictorAttn's error must
  be <= 2 x stock's + 1e-4. Measured rel L2 vs float32: bf16 2.9e-2..3.4e-2,
  fp16 6.8e-4..8.9e-4, PictorAttn within 0.99..1.01 x stock in every case
  (the error is that of the bf16/fp16 weights and projections, shared by both).

Token counts are odd (5x7 image + 11 text = 46, 3x5 + 7 = 22): not multiples
of the kernel's 8-row / 32-key tiles.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import Flux2Attention

import pictor_diffusers.integration.processor as processor_module
from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs

CONFIGS = {
    "double+single": TINY_CONFIG,
    "double-only": {**TINY_CONFIG, "num_single_layers": 0},
    "single-only": {**TINY_CONFIG, "num_layers": 0},
}
# (batch, latent (height, width), text tokens)
CASES = [(1, (5, 7), 11), (2, (3, 5), 7)]
CASE_IDS = ["b1-35img-11txt", "b2-15img-7txt"]
MODEL_VARIANTS = [
    pytest.param(name, fused, id=f"{name}-{'fused' if fused else 'unfused'}")
    for name in CONFIGS
    for fused in (False, True)
    if not (fused and CONFIGS[name]["num_layers"] == 0)  # nothing to fuse without double-stream blocks
]
FP32_REL_L2_TOL = 1e-5
LOW_PRECISION_FACTOR = 2.0
LOW_PRECISION_EPS = 1e-4


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item()


def make_model(config_name: str, fused: bool) -> torch.nn.Module:
    """The seeded float32 model; fused models get stale separate projections.

    After `fuse_qkv_projections()` the separate Q/K/V weights are unused by a
    correct processor; scaling them makes any processor that still reads them
    disagree with the stock (fused) one.
    """
    config = CONFIGS[config_name]
    model = build_transformer(config)
    if fused:
        model.fuse_qkv_projections()
        doubles = [m for m in model.modules() if isinstance(m, Flux2Attention)]
        assert len(doubles) == config["num_layers"]
        for attn in doubles:
            assert attn.fused_projections, "fuse_qkv_projections() did not fuse a Flux2Attention"
            assert isinstance(attn.to_qkv, torch.nn.Linear) and isinstance(attn.to_added_qkv, torch.nn.Linear)
            with torch.no_grad():
                for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                    getattr(attn, name).weight.mul_(2.0)
    return model


def expected_attention_calls(model: torch.nn.Module) -> int:
    return model.config.num_layers + model.config.num_single_layers


def assert_all_pictor(model: torch.nn.Module) -> None:
    processors = model.attn_processors
    assert len(processors) == expected_attention_calls(model)
    wrong = {name: type(p).__name__ for name, p in processors.items() if not isinstance(p, PictorAttn)}
    assert not wrong, f"not PictorAttn after set_attn_processor: {wrong}"


@contextmanager
def count_pictor_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count calls of PictorAttn's attention op, so a forward that bypassed it is caught."""
    calls = [0]
    original = processor_module.attention

    def counting(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return original(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(processor_module, "attention", counting)
        yield calls


def run_both(
    model: torch.nn.Module, inputs: dict, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stock output, PictorAttn output) of `model` on `inputs`; leaves stock processors set."""
    with torch.no_grad():
        set_stock_processors(model)
        stock = model(**inputs)[0]
        model.set_attn_processor(PictorAttn())
        assert_all_pictor(model)
        with count_pictor_attention(monkeypatch) as calls:
            pictor = model(**inputs)[0]
        assert calls[0] == expected_attention_calls(model), f"PictorAttn attention ran {calls[0]} times"
        set_stock_processors(model)
    for out in (stock, pictor):
        assert torch.isfinite(out).all(), "NaN/Inf in the model output"
    assert pictor.shape == stock.shape and pictor.dtype == stock.dtype
    return stock, pictor


def test_processor_class_attributes_and_assignment() -> None:
    assert PictorAttn._attention_backend is None and PictorAttn._parallel_config is None
    model = build_transformer()
    stock_types = {type(p).__name__ for p in model.attn_processors.values()}
    assert stock_types == {"Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}
    model.set_attn_processor(PictorAttn())
    assert_all_pictor(model)
    processor = next(iter(model.attn_processors.values()))
    assert processor._attention_backend is None and processor._parallel_config is None


@pytest.mark.parametrize(("batch", "latent_hw", "text_len"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("config_name", "fused"), MODEL_VARIANTS)
def test_float32_parity(
    config_name: str,
    fused: bool,
    batch: int,
    latent_hw: tuple[int, int],
    text_len: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_model(config_name, fused)
    inputs = transformer_inputs(model, batch, latent_hw, text_len)
    stock, pictor = run_both(model, inputs, monkeypatch)
    assert stock.shape == (batch, latent_hw[0] * latent_hw[1], model.config.in_channels)
    error = rel_l2(pictor, stock)
    assert error <= FP32_REL_L2_TOL, f"rel L2 {error:.3e} > {FP32_REL_L2_TOL} (max-abs {max_abs(pictor, stock):.3e})"


@pytest.mark.parametrize(("batch", "latent_hw", "text_len"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("config_name", "fused"), MODEL_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_within_own_error(
    dtype: torch.dtype,
    config_name: str,
    fused: bool,
    batch: int,
    latent_hw: tuple[int, int],
    text_len: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model32 = make_model(config_name, fused)
    with torch.no_grad():
        reference = model32(**transformer_inputs(model32, batch, latent_hw, text_len))[0]
    model = copy.deepcopy(model32).to(dtype)
    stock, pictor = run_both(model, transformer_inputs(model, batch, latent_hw, text_len), monkeypatch)
    assert pictor.dtype == dtype
    stock_error, pictor_error = rel_l2(stock, reference), rel_l2(pictor, reference)
    bound = LOW_PRECISION_FACTOR * stock_error + LOW_PRECISION_EPS
    assert pictor_error <= bound, (
        f"{dtype}: PictorAttn rel L2 {pictor_error:.3e} vs float32 exceeds {LOW_PRECISION_FACTOR} x stock's "
        f"{stock_error:.3e} + {LOW_PRECISION_EPS} (max-abs {max_abs(pictor, reference):.3e})"
    )
