"""CogVideoX through `PictorAttn`: tiny random `CogVideoXTransformer3DModel`s against stock `CogVideoXAttnProcessor2_0`.

* models: CogVideoX 1.0 without RoPE (2B's layout), with RoPE (5B's) and 1.5 (temporal patches, RoPE on the
  "slice" grid), each with separate and fused (`fuse_qkv_projections()`) projections; batch 1 and 2; 127, 31 and
  147 tokens (1.0) or 67, 19 and 77 (1.5): text + video, none a multiple of 64.
* float32: within 1e-5 relative L2 of stock, and at most 1.5x stock's own error against a float64 run.
* bf16 / fp16 models, precision "fp32" and "auto": at most 1.25x stock's error against the float64 run.
* module by module: RoPE rotates only the video tokens (text first), as stock; stock's `(video, text)` return.
* errors: RoPE tables of the wrong length (one for text + video included), masks, cross-attention modules.
* `torch.compile(fullgraph=True)` (aot_eager): no graph break, eager's output.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from bypass_helpers import (
    assert_compiles_to_eager,
    assert_float32_parity,
    assert_low_precision,
    fuse_with_stale_projections,
)
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.bypass_models import (
    TINY_COGVIDEOX15_CONFIG,
    TINY_COGVIDEOX_CONFIG,
    TINY_COGVIDEOX_ROPE_CONFIG,
    build_cogvideox,
    cogvideox_inputs,
)
from pictor_diffusers.testing.references import rel_l2

CONFIGS = {"1.0": TINY_COGVIDEOX_CONFIG, "1.0-rope": TINY_COGVIDEOX_ROPE_CONFIG, "1.5": TINY_COGVIDEOX15_CONFIG}
# (batch, latent frames, latent (height, width)); 7 text tokens (the sin-cos positions of 1.0 fix the text length)
CASES = [(1, 4, (10, 12)), (2, 2, (6, 8)), (1, 2, (14, 20))]
CASE_IDS = ["b1-f4-10x12", "b2-f2-6x8", "b1-f2-14x20"]
TEXT_LEN = 7
F32_REL_L2_TOL = 1e-5
WIDTH, HEADS, HEAD_DIM = 32, 2, 16


@pytest.mark.parametrize(("batch", "frames", "latent_hw"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_parity(name: str, fused: bool, batch: int, frames: int, latent_hw: tuple, monkeypatch) -> None:
    model = build_cogvideox(CONFIGS[name])
    inputs = cogvideox_inputs(model, batch, frames, latent_hw, TEXT_LEN)
    fuse = fuse_with_stale_projections if fused else None
    assert_float32_parity(model, inputs, CogVideoXAttnProcessor2_0(), monkeypatch, fuse)


@pytest.mark.parametrize("precision", ["fp32", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["1.0", "1.5"])
def test_low_precision_within_stock_error(name: str, dtype: torch.dtype, precision: str, monkeypatch) -> None:
    model = build_cogvideox(CONFIGS[name])
    inputs = partial(cogvideox_inputs, batch=2, frames=2, latent_hw=(10, 12), text_len=TEXT_LEN)
    assert_low_precision(model, inputs, CogVideoXAttnProcessor2_0(), dtype, precision, monkeypatch)


def cogvideox_attention() -> Attention:
    """An `Attention` as `CogVideoXBlock` builds it, with random LayerNorm weights and biases."""
    torch.manual_seed(0)
    attn = Attention(query_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS, qk_norm="layer_norm", eps=1e-6, bias=True)
    with torch.no_grad():
        for norm in (attn.norm_q, attn.norm_k):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
    return attn.eval()


def random_rope(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each `[tokens, HEAD_DIM]` with interleaved pairs of random angles."""
    angles = torch.rand(tokens, HEAD_DIM // 2, generator=torch.Generator().manual_seed(3)) * 6.3
    return angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
def test_module_rotates_video_tokens_only(with_rope: bool) -> None:
    attn = cogvideox_attention()
    generator = torch.Generator().manual_seed(2)
    video, text = torch.randn(2, 23, WIDTH, generator=generator), torch.randn(2, 5, WIDTH, generator=generator)
    rope = random_rope(23) if with_rope else None
    with torch.no_grad():
        stock = CogVideoXAttnProcessor2_0()(attn, video, text, None, rope)
        pictor = PictorAttn()(attn, video, text, None, rope)
    assert type(pictor) is tuple and len(pictor) == 2
    for expected, actual in zip(stock, pictor, strict=True):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert rel_l2(actual, expected) <= F32_REL_L2_TOL


def test_call_errors() -> None:
    attn = cogvideox_attention()
    video, text = torch.randn(1, 6, WIDTH), torch.randn(1, 3, WIDTH)
    with pytest.raises(ValueError, match=r"must be \(cos, sin\), each \[6, head_dim\] for the 6 video tokens; got"):
        PictorAttn()(attn, video, text, image_rotary_emb=random_rope(9))
    with pytest.raises(ValueError, match=r"got an attention_mask of shape \(1, 9\)"):
        PictorAttn()(attn, video, text, torch.ones(1, 9, dtype=torch.bool))
    cross = Attention(query_dim=WIDTH, cross_attention_dim=WIDTH, dim_head=HEAD_DIM, heads=HEADS)
    with pytest.raises(TypeError, match=r"this one has is_cross_attention=True \(set by cross_attention_dim\)"):
        PictorAttn()(cross, video, text)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
def test_compiles_without_graph_breaks() -> None:
    """`torch.compile(fullgraph=True)` through CogVideoX 1.5 (LayerNorm QK norms, RoPE): eager's output."""
    model = build_cogvideox(TINY_COGVIDEOX15_CONFIG)
    assert_compiles_to_eager(model, cogvideox_inputs(model, 1, 2, (6, 8), TEXT_LEN))
