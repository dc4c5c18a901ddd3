"""Models and masks made under `torch.inference_mode` (inference tensors have no version counter, which the
caches of 16-bit norm-weight casts and of key-padding masks read): served and right, on CPU."""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import PictorAttn
from pictor_diffusers.ops.prologue import _FLOAT_WEIGHTS, float_weight
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs


def test_float_weight_of_an_inference_tensor_is_a_plain_cast() -> None:
    with torch.inference_mode():
        weight = torch.randn(64).to(torch.bfloat16)
        cast = float_weight(weight)
    assert cast.dtype == torch.float32 and torch.equal(cast, weight.float())
    assert weight not in _FLOAT_WEIGHTS


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_built_under_inference_mode(precision: str) -> None:
    """A bf16 tiny FLUX.2 whose parameters are inference tensors: PictorAttn runs, close to stock."""
    with torch.inference_mode():
        model = build_transformer(TINY_CONFIG, dtype=torch.bfloat16)
        inputs = transformer_inputs(model, batch=1, latent_hw=(3, 5), text_len=7)
        set_stock_processors(model)
        stock = model(**inputs)[0].double()
        model.set_attn_processor(PictorAttn(precision=precision))
        ours = model(**inputs)[0].double()
    assert ((ours - stock).norm() / stock.norm()).item() < 2e-2
