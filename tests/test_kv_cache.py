"""FLUX.2-klein's reference-image KV cache through PictorAttn, against diffusers' KV processors (CPU).

A tiny random FLUX.2 transformer runs the two modes of `Flux2KleinKVPipeline`:
"extract" (reference latents before the image latents, `num_ref_tokens` > 0)
and then "cached" (image latents only, the cache from the extract step), once
with diffusers' `Flux2KVAttnProcessor` / `Flux2KVParallelSelfAttnProcessor` and
once with `PictorAttn`. Shapes are odd on purpose (7 text tokens, 3x5 image,
2x3 reference).
"""

from __future__ import annotations

import pytest
import torch
from kv_helpers import IMAGE_HW, REF_HW, TEXT_LEN, kv_steps

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import (
    HAS_KV_PROCESSORS,
    TINY_CONFIG,
    build_transformer,
    set_kv_processors,
    transformer_inputs,
)
from pictor_diffusers.testing.references import rel_l2

pytestmark = pytest.mark.skipif(
    not HAS_KV_PROCESSORS, reason="this diffusers has no FLUX.2-klein KV processors (Flux2KVAttnProcessor)"
)

REL_TOL = 1e-5
FP8_REL = 3e-3
"""fp8 vs stock on the tiny model (measured 5e-4; bf16 5e-5): the output after P and V's 3-bit mantissas."""


@pytest.mark.parametrize("batch", [1, 2])
def test_both_modes_match_diffusers_kv_processors(batch: int) -> None:
    model = build_transformer(seed=0)
    set_kv_processors(model)
    stock_extract, stock_cached, _ = kv_steps(model, batch)
    model.set_attn_processor(PictorAttn())
    extract, cached, cache = kv_steps(model, batch)
    assert extract.shape == stock_extract.shape and cached.shape == stock_cached.shape
    assert rel_l2(extract, stock_extract) <= REL_TOL
    assert rel_l2(cached, stock_cached) <= REL_TOL
    k_ref, v_ref = cache.get_double(0).get()
    heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
    assert k_ref.shape == v_ref.shape == (batch, REF_HW[0] * REF_HW[1], heads, head_dim)


def test_fp8_modes_stay_within_its_quantisation_error() -> None:
    """Both KV modes on the 8-bit path (its CPU twin here, at the kernel's head_dim 128) against diffusers'
    processors."""
    model = build_transformer({**TINY_CONFIG, "attention_head_dim": 128, "axes_dims_rope": (32,) * 4}, seed=0)
    set_kv_processors(model)
    stock_extract, stock_cached, _ = kv_steps(model, 1)
    model.set_attn_processor(PictorAttn(precision="fp8"))
    extract, cached, _ = kv_steps(model, 1)
    assert rel_l2(extract, stock_extract) <= FP8_REL and rel_l2(cached, stock_cached) <= FP8_REL


def test_a_cache_written_by_diffusers_serves_pictor() -> None:
    model = build_transformer(seed=0)
    set_kv_processors(model)
    _, stock_cached, stock_cache = kv_steps(model, 1)
    model.set_attn_processor(PictorAttn())
    _, cached, _ = kv_steps(model, 1, cache=stock_cache)
    assert rel_l2(cached, stock_cached) <= REL_TOL


def test_a_cache_of_another_shape_is_refused() -> None:
    model = build_transformer(seed=0)
    model.set_attn_processor(PictorAttn())
    _, _, cache = kv_steps(model, 1)
    layer = cache.get_double(0)
    k_ref, v_ref = layer.get()
    layer.store(k_ref[:, :, :1], v_ref[:, :, :1])
    inputs = transformer_inputs(model, 1, IMAGE_HW, TEXT_LEN, seed=3)
    with pytest.raises(ValueError, match=r"the KV cache holds reference keys of shape \(1, 6, 1, 32\)"):
        model(**inputs, kv_cache=cache, kv_cache_mode="cached")


def test_an_unknown_mode_is_refused() -> None:
    model = build_transformer(seed=0)
    model.set_attn_processor(PictorAttn())
    inputs = transformer_inputs(model, 1, IMAGE_HW, TEXT_LEN, seed=3)
    block = model.transformer_blocks[0]
    with pytest.raises(ValueError, match="kv_cache_mode must be one of"):
        block.attn.processor(block.attn, torch.randn(1, 15, 128), encoder_hidden_states=torch.randn(1, 7, 128),
                             kv_cache_mode="replay")  # fmt: skip
    assert inputs
