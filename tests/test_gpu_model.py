"""PictorAttn inside FLUX.2 transformers on CUDA: parity, torch.compile, klein-4B shape."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import KLEIN_4B_CONFIG, build_transformer, set_stock_processors, transformer_inputs
from pictor_diffusers.testing.timing import median_ms

pytestmark = pytest.mark.gpu


def _rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_tiny_transformer_fp32_parity(batch: int, fused: bool) -> None:
    model = build_transformer(device="cuda")
    if fused:
        model.fuse_qkv_projections()
    inputs = transformer_inputs(model, batch=batch, latent_hw=(9, 13), text_len=21)
    stock = model(**inputs)[0]
    model.set_attn_processor(PictorAttn())
    ours = model(**inputs)[0]
    assert not ours.isnan().any()
    assert _rel_l2(ours, stock) <= 1e-5


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tiny_transformer_16bit_within_stock_error(dtype: torch.dtype) -> None:
    exact = build_transformer(device="cuda")
    inputs32 = transformer_inputs(exact, batch=2, latent_hw=(9, 13), text_len=21)
    truth = exact(**inputs32)[0]
    model = build_transformer(device="cuda", dtype=dtype)
    inputs = transformer_inputs(model, batch=2, latent_hw=(9, 13), text_len=21)
    stock_err = _rel_l2(model(**inputs)[0], truth)
    model.set_attn_processor(PictorAttn())
    ours_err = _rel_l2(model(**inputs)[0], truth)
    print(f"{dtype}: stock rel err {stock_err:.3e}, PictorAttn rel err {ours_err:.3e}")
    assert ours_err <= 2.0 * stock_err + 1e-3


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tensor_core_path_matches_reference_kernel(dtype: torch.dtype) -> None:
    """PictorAttn() (fused prologue + 3xTF32) against PictorAttn("f32") on a whole model."""
    model = build_transformer(device="cuda", dtype=dtype)
    inputs = transformer_inputs(model, batch=2, latent_hw=(9, 13), text_len=21)
    model.set_attn_processor(PictorAttn(kernel="f32"))
    reference = model(**inputs)[0]
    model.set_attn_processor(PictorAttn())
    fast = model(**inputs)[0]
    tolerance = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert _rel_l2(fast, reference) <= tolerance


@torch.no_grad()
def test_torch_compile_fullgraph() -> None:
    model = build_transformer(device="cuda")
    model.set_attn_processor(PictorAttn())
    inputs = transformer_inputs(model, batch=1, latent_hw=(8, 8), text_len=16)
    eager = model(**inputs)[0]
    compiled = torch.compile(model, fullgraph=True)
    traced = compiled(**inputs)[0]
    assert _rel_l2(traced, eager) <= 1e-5


def _forward_ms(model: torch.nn.Module, inputs: dict, repeats: int = 5) -> tuple[torch.Tensor, float]:
    """(output, median ms of `repeats` forwards after it, host time included)."""
    out = model(**inputs)[0]
    return out, median_ms(lambda: model(**inputs), warmup=0, timed=repeats, hold=False)


@pytest.fixture(scope="module")
def klein_4b() -> Iterator[tuple[torch.nn.Module, dict, torch.Tensor, float]]:
    """A klein-4B-shaped bf16 transformer, 512 text + 4096 image tokens, and its stock (output, ms)."""
    with torch.device("cuda"):
        model = build_transformer(KLEIN_4B_CONFIG, dtype=torch.bfloat16)
    inputs = transformer_inputs(model, batch=1, latent_hw=(64, 64), text_len=512)
    set_stock_processors(model)
    with torch.no_grad():
        stock, stock_ms = _forward_ms(model, inputs)
    yield model, inputs, stock, stock_ms
    del model
    torch.cuda.empty_cache()


def _record(name: str, record: dict) -> None:
    print("KLEIN4B", json.dumps(record))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as handle:
            json.dump(record, handle)


@pytest.mark.slow
@torch.no_grad()
def test_klein_4b_shaped_transformer(klein_4b: tuple) -> None:
    """24 heads, 5 double + 20 single blocks, bf16 random weights, 512 text + 4096 image tokens."""
    model, inputs, stock, stock_ms = klein_4b
    model.set_attn_processor(PictorAttn())
    ours, ours_ms = _forward_ms(model, inputs)
    rel = _rel_l2(ours, stock)
    record = {
        "shape": "klein-4B 1024^2 (512+4096 tokens) bf16, PictorAttn()",
        "stock_ms": stock_ms,
        "pictor_ms": ours_ms,
        "rel_l2_vs_stock": rel,
        "ratio": ours_ms / stock_ms,
    }
    _record("klein4b_forward", record)
    assert torch.isfinite(ours).all()
    assert rel <= 5e-2


@pytest.mark.slow
@torch.no_grad()
def test_klein_4b_shaped_transformer_bf16_path(klein_4b: tuple) -> None:
    """precision="bf16" against stock, within 2x the spread of stock's own SDPA backends (default vs math)."""
    model, inputs, stock, stock_ms = klein_4b
    set_stock_processors(model)
    with sdpa_kernel(SDPBackend.MATH):
        spread = _rel_l2(model(**inputs)[0], stock)
    model.set_attn_processor(PictorAttn(precision="bf16"))
    ours, ours_ms = _forward_ms(model, inputs)
    rel = _rel_l2(ours, stock)
    record = {
        "shape": "klein-4B 1024^2 (512+4096 tokens) bf16, PictorAttn(precision='bf16')",
        "stock_ms": stock_ms,
        "pictor_ms": ours_ms,
        "rel_l2_vs_stock": rel,
        "stock_math_rel_l2_vs_stock": spread,
        "ratio": ours_ms / stock_ms,
    }
    _record("klein4b_forward_bf16", record)
    assert torch.isfinite(ours).all()
    assert rel <= 2.0 * spread + 1e-4, f"rel L2 {rel:.3e} > 2 x stock's backend spread {spread:.3e} + 1e-4"
