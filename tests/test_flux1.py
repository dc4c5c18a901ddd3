"""FLUX.1 through `PictorAttn`: tiny random `FluxTransformer2DModel`s against stock `FluxAttnProcessor`.

* RoPE: FLUX.1's `FluxPosEmbed` tables rotated by `prologue.apply_rope` equal
  diffusers' `apply_rotary_emb(..., sequence_dim=1)`.
* float32 models: relative L2 <= 1e-5 over the whole transformer, separate and
  fused (`fuse_qkv_projections()`) projections, double+single, double-only and
  single-only; token counts 22, 46 and 141 (not multiples of 128).
* bf16 / fp16 models: error against the float32 model <= 2 x stock's + 1e-4.
* module by module: the same return structure as stock (a pair from double-
  stream calls, the unprojected attention output from `pre_only` ones).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, FluxPosEmbed

import pictor_diffusers.ops.attention as ops_module
from pictor_diffusers import PictorAttn
from pictor_diffusers.ops.prologue import apply_rope
from pictor_diffusers.testing.models import TINY_FLUX1_CONFIG

TINY_FLUX1 = {**TINY_FLUX1_CONFIG, "num_attention_heads": 3}
CONFIGS = {
    "double+single": TINY_FLUX1,
    "double-only": {**TINY_FLUX1, "num_single_layers": 0},
    "single-only": {**TINY_FLUX1, "num_layers": 0},
}
MODEL_VARIANTS = [
    pytest.param(name, fused, id=f"{name}-{'fused' if fused else 'unfused'}") for name in CONFIGS for fused in (0, 1)
]
# (batch, latent (height, width), text tokens): 46, 22 and 141 tokens
CASES = [(1, (5, 7), 11), (2, (3, 5), 7), (1, (11, 12), 9)]
CASE_IDS = ["b1-46tok", "b2-22tok", "b1-141tok"]
FP32_REL_L2_TOL = 1e-5


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def build_flux1(config: dict | None = None, seed: int = 0) -> FluxTransformer2DModel:
    """A FLUX.1 transformer with seeded random weights, float32, eval mode."""
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**(config or TINY_FLUX1)).eval()


def flux1_ids(latent_hw: tuple[int, int], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids `[h*w, 3]` = (0, row, column), text ids `[text_len, 3]` = 0), as FLUX.1 pipelines make them."""
    height, width = latent_hw
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.stack([torch.zeros(height * width), rows.flatten().float(), cols.flatten().float()], dim=-1)
    return image, torch.zeros(text_len, 3)


def flux1_inputs(model: FluxTransformer2DModel, batch: int, latent_hw: tuple[int, int], text_len: int) -> dict:
    """Seeded N(0, 1) keyword inputs for `model.forward` in the model's dtype."""
    config, dtype = model.config, next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(1)
    image_ids, text_ids = flux1_ids(latent_hw, text_len)
    tokens = latent_hw[0] * latent_hw[1]
    inputs = {
        "hidden_states": torch.randn(batch, tokens, config.in_channels, generator=generator).to(dtype),
        "encoder_hidden_states": torch.randn(batch, text_len, config.joint_attention_dim, generator=generator).to(
            dtype
        ),
        "pooled_projections": torch.randn(batch, config.pooled_projection_dim, generator=generator).to(dtype),
        "timestep": torch.full((batch,), 0.5, dtype=dtype),
        "img_ids": image_ids,
        "txt_ids": text_ids,
        "return_dict": False,
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, dtype=dtype)
    return inputs


def attention_modules(model: torch.nn.Module) -> int:
    return sum(isinstance(m, FluxAttention) for m in model.modules())


@contextmanager
def count_pictor_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count runs of pictor's attention implementation: a resolved plan (the kernels, `launch.run`) or the
    CPU twin, as `attention` reaches them."""
    calls = [0]

    def counted(original: Callable[..., object]) -> Callable[..., object]:
        def counting(*args: object) -> object:
            calls[0] += 1
            return original(*args)

        return counting

    with monkeypatch.context() as patch:
        for name in ("run", "twin_attention"):
            patch.setattr(ops_module, name, counted(getattr(ops_module, name)))
        yield calls


def make_model(config_name: str, fused: bool) -> FluxTransformer2DModel:
    """The seeded float32 model; fused ones get stale separate projections (x2), so a processor
    that still reads them disagrees with stock."""
    model = build_flux1(CONFIGS[config_name])
    if fused:
        model.fuse_qkv_projections()
        modules = [m for m in model.modules() if isinstance(m, FluxAttention)]
        assert modules and all(m.fused_projections for m in modules)
        with torch.no_grad():
            for attn in modules:
                for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                    if hasattr(attn, name):
                        getattr(attn, name).weight.mul_(2.0)
    return model


def run_both(
    model: FluxTransformer2DModel, inputs: dict, monkeypatch: pytest.MonkeyPatch, processor: PictorAttn
) -> tuple[torch.Tensor, torch.Tensor]:
    """(stock output, PictorAttn output); leaves stock processors set."""
    with torch.no_grad():
        model.set_attn_processor(FluxAttnProcessor())
        stock = model(**inputs)[0]
        model.set_attn_processor(processor)
        assert all(isinstance(p, PictorAttn) for p in model.attn_processors.values())
        with count_pictor_calls(monkeypatch) as calls:
            pictor = model(**inputs)[0]
        model.set_attn_processor(FluxAttnProcessor())
    assert calls[0] == attention_modules(model), f"pictor ran {calls[0]} of {attention_modules(model)} attentions"
    assert torch.isfinite(stock).all() and torch.isfinite(pictor).all()
    assert pictor.shape == stock.shape and pictor.dtype == stock.dtype
    return stock, pictor


@pytest.mark.parametrize(("latent_hw", "text_len"), [((5, 7), 11), ((11, 12), 9)], ids=["46tok", "141tok"])
def test_rope_layout_matches_flux1(latent_hw: tuple[int, int], text_len: int) -> None:
    image_ids, text_ids = flux1_ids(latent_hw, text_len)
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(TINY_FLUX1["axes_dims_rope"]))(torch.cat([text_ids, image_ids]))
    tokens, head_dim = text_len + latent_hw[0] * latent_hw[1], TINY_FLUX1["attention_head_dim"]
    assert cos.shape == sin.shape == (tokens, head_dim)
    x = torch.randn(2, tokens, 3, head_dim, generator=torch.Generator().manual_seed(0))
    expected = apply_rotary_emb(x, (cos, sin), sequence_dim=1)
    assert not torch.allclose(expected, x, atol=1e-2), "RoPE did nothing: the check would be vacuous"
    assert (apply_rope(x, (cos, sin)) - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize(("batch", "latent_hw", "text_len"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("config_name", "fused"), MODEL_VARIANTS)
def test_float32_parity(
    config_name: str, fused: bool, batch: int, latent_hw: tuple[int, int], text_len: int, monkeypatch
) -> None:
    model = make_model(config_name, fused)
    stock, pictor = run_both(model, flux1_inputs(model, batch, latent_hw, text_len), monkeypatch, PictorAttn())
    assert stock.shape == (batch, latent_hw[0] * latent_hw[1], model.config.in_channels)
    error = rel_l2(pictor, stock)
    assert error <= FP32_REL_L2_TOL, f"rel L2 {error:.3e} > {FP32_REL_L2_TOL}"


@pytest.mark.parametrize("precision", ["fp32", "auto"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("config_name", "fused"), [("double+single", 0), ("double+single", 1)], ids=["unfused", "fused"]
)
def test_low_precision_within_own_error(
    config_name: str, fused: bool, dtype: torch.dtype, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model32 = make_model(config_name, fused)
    with torch.no_grad():
        reference = model32(**flux1_inputs(model32, 2, (5, 7), 11))[0]
    model = copy.deepcopy(model32).to(dtype)
    inputs = flux1_inputs(model, 2, (5, 7), 11)
    stock, pictor = run_both(model, inputs, monkeypatch, PictorAttn(precision=precision))
    stock_error, pictor_error = rel_l2(stock, reference), rel_l2(pictor, reference)
    bound = 2.0 * stock_error + 1e-4
    assert pictor_error <= bound, f"{dtype} {precision}: rel L2 {pictor_error:.3e} > 2 x stock's {stock_error:.3e}"


def module_rope(tokens: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randn(tokens, 3, generator=torch.Generator().manual_seed(3)) * 4
    return FluxPosEmbed(theta=10000, axes_dim=[8, 8, head_dim - 16])(ids)


MODULE_KINDS = {
    "double": {"added_kv_proj_dim": 40, "context_pre_only": False},
    "single-pre_only": {"pre_only": True},
    "plain-no-text": {},
}


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("kind", list(MODULE_KINDS))
def test_module_return_structure(kind: str, fused: bool) -> None:
    torch.manual_seed(0)
    attn = FluxAttention(query_dim=48, heads=2, dim_head=32, bias=True, eps=1e-6, **MODULE_KINDS[kind])
    if fused:
        attn.fuse_projections()
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 13, 48, generator=generator)
    text = torch.randn(2, 5, 40, generator=generator) if kind == "double" else None
    rope = module_rope(13 + (5 if text is not None else 0), 32)
    with torch.no_grad():
        stock = FluxAttnProcessor()(attn, hidden, text, None, rope)
        pictor = PictorAttn()(attn, hidden, text, None, rope)
    assert type(pictor) is type(stock)
    pairs = list(zip(stock, pictor, strict=True)) if isinstance(stock, tuple) else [(stock, pictor)]
    assert len(pairs) == (2 if kind == "double" else 1)
    for expected, actual in pairs:
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert rel_l2(actual, expected) <= FP32_REL_L2_TOL


def test_module_errors() -> None:
    torch.manual_seed(0)
    attn = FluxAttention(query_dim=48, heads=2, dim_head=32, pre_only=True)
    hidden = torch.randn(1, 6, 48)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 1, 6, 6\)"):
        PictorAttn()(attn, hidden, None, mask, None)
    with pytest.raises(ValueError, match="added_kv_proj_dim=None"):
        PictorAttn()(attn, hidden, encoder_hidden_states=torch.randn(1, 2, 48))
