"""SD3 / SD3.5 through `PictorAttn`: tiny random `SD3Transformer2DModel`s against stock `JointAttnProcessor2_0`.

* models: SD3 (no QK norm), SD3.5 (diffusers' RMSNorm QK norms, dual-attention `attn2` blocks) and LayerNorm QK
  norms, each with separate and fused (`fuse_qkv_projections()`) projections; batch 1 and 2; 76, 72 and 128
  tokens (text + image: two not multiples of 64).
* float32: within 1e-5 relative L2 of stock, and at most 1.5x stock's own error against a float64 run.
* bf16 / fp16 models, precision "fp32" and "auto": at most 1.25x stock's error against the float64 run.
* module by module: joint attention (with and without `context_pre_only`) and self-attention, every QK norm:
  stock's return structure and values.
* errors: settings SD3 never uses (each naming the attribute), other QK norms (also at the prologue), subclasses,
  masks, RoPE, 4-D input.
* `torch.compile(fullgraph=True)` (aot_eager): no graph break, eager's output.
"""

from __future__ import annotations

import re
from functools import partial

import pytest
import torch
from bypass_helpers import (
    assert_compiles_to_eager,
    assert_float32_parity,
    assert_low_precision,
    fuse_with_stale_projections,
)
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from diffusers.models.normalization import RMSNorm

from pictor_diffusers import PictorAttn
from pictor_diffusers.integration.adapters import adapter_for
from pictor_diffusers.integration.adapters.attention import AttentionAdapter
from pictor_diffusers.ops.prologue import Segment, pack_head_major
from pictor_diffusers.testing.bypass_models import TINY_SD3_CONFIG, TINY_SD35_CONFIG, build_sd3, sd3_inputs
from pictor_diffusers.testing.references import rel_l2

CONFIGS = {
    "sd3": TINY_SD3_CONFIG,
    "sd3.5": TINY_SD35_CONFIG,
    "layer_norm": {**TINY_SD3_CONFIG, "dual_attention_layers": (1,), "qk_norm": "layer_norm"},
}
# (batch, latent (height, width), text tokens): 63 + 13, 65 + 7 and 64 + 64 tokens
CASES = [(1, (9, 7), 13), (2, (5, 13), 7), (2, (8, 8), 64)]
CASE_IDS = ["b1-76tok", "b2-72tok", "b2-128tok"]
F32_REL_L2_TOL = 1e-5
WIDTH, HEADS, HEAD_DIM = 48, 3, 16


@pytest.mark.parametrize(("batch", "latent_hw", "text_len"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_parity(name: str, fused: bool, batch: int, latent_hw: tuple, text_len: int, monkeypatch) -> None:
    model = build_sd3(CONFIGS[name])
    inputs = sd3_inputs(model, batch, latent_hw, text_len)
    fuse = fuse_with_stale_projections if fused else None
    assert_float32_parity(model, inputs, JointAttnProcessor2_0(), monkeypatch, fuse)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["sd3", "sd3.5"])
def test_low_precision_within_stock_error(name: str, dtype: torch.dtype, precision: str, monkeypatch) -> None:
    model = build_sd3(CONFIGS[name])
    inputs = partial(sd3_inputs, batch=2, latent_hw=(9, 7), text_len=13)
    assert_low_precision(model, inputs, JointAttnProcessor2_0(), dtype, precision, monkeypatch)


def sd3_attention(qk_norm: str | None, joint: bool, context_pre_only: bool = False) -> Attention:
    """An `Attention` as `JointTransformerBlock` builds it (joint) or its `attn2` (not), with random norm weights."""
    torch.manual_seed(0)
    kwargs = {"added_kv_proj_dim": WIDTH, "context_pre_only": context_pre_only} if joint else {}
    attn = Attention(query_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS, out_dim=WIDTH, bias=True, qk_norm=qk_norm,
                     eps=1e-6, **kwargs)  # fmt: skip
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if name.startswith("norm_"):
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.normal_()
    return attn.eval()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("qk_norm", [None, "rms_norm", "layer_norm"], ids=str)
@pytest.mark.parametrize("kind", ["joint", "joint-context_pre_only", "self"])
def test_module_matches_stock(kind: str, qk_norm: str | None, fused: bool) -> None:
    attn = sd3_attention(qk_norm, kind != "self", kind.endswith("context_pre_only"))
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 19, WIDTH, generator=generator)
    text = None if kind == "self" else torch.randn(2, 6, WIDTH, generator=generator)
    with torch.no_grad():
        stock = JointAttnProcessor2_0()(attn, hidden, text)
        if fused:
            attn.fuse_projections()
        pictor = PictorAttn()(attn, hidden, text)
    assert isinstance(adapter_for(attn), AttentionAdapter)
    assert type(pictor) is type(stock)
    pairs = list(zip(stock, pictor, strict=True)) if isinstance(stock, tuple) else [(stock, pictor)]
    assert len(pairs) == (1 if text is None else 2)
    for expected, actual in pairs:
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert rel_l2(actual, expected) <= F32_REL_L2_TOL


UNSERVED_SETTINGS = {
    "cross_attention_dim": ({"cross_attention_dim": 32}, "is_cross_attention=True (set by cross_attention_dim)"),
    "norm_num_groups": ({"norm_num_groups": 8}, "group_norm=GroupNorm (set by norm_num_groups)"),
    "spatial_norm_dim": ({"spatial_norm_dim": 4}, "spatial_norm=SpatialNorm (set by spatial_norm_dim)"),
    "cross_attention_norm": ({"cross_attention_norm": "layer_norm"}, "norm_cross=LayerNorm (set by"),
    "residual_connection": ({"residual_connection": True}, "residual_connection=True (set by residual_connection)"),
    "rescale_output_factor": ({"rescale_output_factor": 2.0}, "rescale_output_factor=2.0"),
    "pre_only": ({"pre_only": True}, "pre_only=True (set by pre_only)"),
    "kv_heads": ({"kv_heads": 1}, "grouped K/V heads (inner_kv_dim=16, inner_dim=64)"),
    "added_kv": ({"added_kv_proj_dim": 64}, "added K/V projections without add_q_proj (context_pre_only=None)"),
}


@pytest.mark.parametrize("setting", list(UNSERVED_SETTINGS))
def test_unserved_settings_name_the_attribute(setting: str) -> None:
    kwargs, message = UNSERVED_SETTINGS[setting]
    attn = Attention(query_dim=64, dim_head=HEAD_DIM, heads=4, **kwargs)  # 64 channels: 32 groups for SpatialNorm
    expected = "PictorAttn serves Attention as SD3, SD3.5 and CogVideoX configure it; this one has "
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}.*{re.escape(message)}.*which it does not serve$"):
        PictorAttn()(attn, torch.randn(1, 4, 64))


UNSERVED_NORMS = {
    "l2": ({"qk_norm": "l2"}, "Attention.norm_q is a LpNorm"),
    "rms_norm_across_heads": (
        {"qk_norm": "rms_norm_across_heads", "kv_heads": HEADS},
        "Attention.norm_q is a RMSNorm over (48,)",
    ),
    "layer_norm_across_heads": (
        {"qk_norm": "layer_norm_across_heads", "kv_heads": HEADS},
        "Attention.norm_q is a LayerNorm over (48,)",
    ),
}


@pytest.mark.parametrize("norm", list(UNSERVED_NORMS))
def test_unserved_qk_norms_name_the_attribute(norm: str) -> None:
    kwargs, message = UNSERVED_NORMS[norm]
    attn = Attention(query_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS, **kwargs)
    served = "PictorAttn serves QK norms over each head's 16 channels (RMSNorm, LayerNorm or none); "
    with pytest.raises(TypeError, match=f"^{re.escape(served + message)}$"):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH))


def test_rms_norm_with_bias_is_refused() -> None:
    attn = sd3_attention("rms_norm", joint=True)
    attn.norm_added_k = RMSNorm(HEAD_DIM, eps=1e-6, bias=True)
    with pytest.raises(TypeError, match=re.escape("Attention.norm_added_k is a RMSNorm over (16,) with a bias")):
        PictorAttn()(attn, torch.randn(1, 4, WIDTH), torch.randn(1, 3, WIDTH))


def test_call_errors() -> None:
    attn = sd3_attention("rms_norm", joint=True)
    hidden, text = torch.randn(1, 4, WIDTH), torch.randn(1, 3, WIDTH)
    with pytest.raises(ValueError, match=r"as SD3 or CogVideoX uses it; got an attention_mask of shape \(1, 7\)$"):
        PictorAttn()(attn, hidden, text, torch.ones(1, 7, dtype=torch.bool))
    rope = (torch.ones(7, HEAD_DIM), torch.zeros(7, HEAD_DIM))
    with pytest.raises(
        TypeError, match=r"Attention as SD3 does \(JointAttnProcessor2_0\), without RoPE, but got image_"
    ):
        PictorAttn()(attn, hidden, text, image_rotary_emb=rope)
    with pytest.raises(ValueError, match=r"hidden_states \[B, N, C\] for Attention, got shape \(1, 48, 2, 2\)$"):
        PictorAttn()(attn, torch.randn(1, WIDTH, 2, 2), text)
    subclass = type("MyAttention", (Attention,), {})(query_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS)
    with pytest.raises(TypeError, match=r"^PictorAttn serves diffusers' Attention .* not its subclass MyAttention$"):
        PictorAttn()(subclass, hidden)


def test_prologue_refuses_other_norms() -> None:
    projections = [torch.randn(1, 5, 32) for _ in range(3)]
    with pytest.raises(TypeError, match=r"^PictorAttn expects RMSNorm, LayerNorm or no QK norms, got Identity$"):
        pack_head_major([Segment(*projections, torch.nn.Identity(), None)], 16, None)
    with pytest.raises(ValueError, match=r"^a LayerNorm QK norm must normalise head_dim=16, not \(32,\)$"):
        pack_head_major([Segment(*projections, torch.nn.LayerNorm(32), None)], 16, None)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_compiles_without_graph_breaks() -> None:
    """`torch.compile(fullgraph=True)` through SD3.5 (RMSNorm and norm-free attentions): eager's output."""
    model = build_sd3(TINY_SD35_CONFIG)
    assert_compiles_to_eager(model, sd3_inputs(model, 1, (5, 7), 9))
