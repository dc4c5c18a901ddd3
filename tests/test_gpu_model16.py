"""PictorAttn(precision="bf16"/"fp16") inside tiny FLUX.2 transformers on CUDA.

The yardstick is how far two stock runs of the same 16-bit model lie apart:
SDPA's default backend (flash / cuDNN) against its math backend. PictorAttn's
16-bit path must land within 2x that distance (+ 1e-4) of the default stock
output. Head dims 128 and 64 reach the 16-bit kernels (wgmma on Hopper at 128,
mma16 otherwise); each test counts the launches to prove it. The klein-4B
shaped test lives in test_gpu_model.py, next to its fp32 twin.
"""

from __future__ import annotations

import pytest
import torch
from launch_counts import count_launches
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs

pytestmark = pytest.mark.gpu

CONFIGS = {
    "d128": {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32, 32, 32, 32)},
    "d64": {**TINY_CONFIG, "attention_head_dim": 64, "num_attention_heads": 3, "axes_dims_rope": (16, 16, 16, 16)},
}
YARDSTICK_FACTOR, YARDSTICK_FLOOR = 2.0, 1e-4
PRECISION_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def kernel_launches(model: torch.nn.Module) -> int:
    """16-bit kernel launches of one forward: one per attention layer where a kernel measured faster than
    SDPA runs the head_dim (wgmma at 64 and 128 on sm_90); elsewhere "auto" hands the calls to SDPA."""
    tuned = torch.cuda.get_device_capability() == (9, 0) and model.config.attention_head_dim in (64, 128)
    return model.config.num_layers + model.config.num_single_layers if tuned else 0


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@torch.no_grad()
def stock_outputs(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(default-backend SDPA output, math-backend SDPA output) of the stock processors."""
    set_stock_processors(model)
    default = model(**inputs)[0]
    with sdpa_kernel(SDPBackend.MATH):
        math = model(**inputs)[0]
    return default, math


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", list(PRECISION_OF), ids=str)
def test_16bit_precision_within_stock_spread(
    dtype: torch.dtype, config: str, batch: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_transformer(CONFIGS[config], device="cuda", dtype=dtype)
    if fused:
        model.fuse_qkv_projections()
    inputs = transformer_inputs(model, batch=batch, latent_hw=(9, 13), text_len=21)
    stock, stock_math = stock_outputs(model, inputs)
    model.set_attn_processor(PictorAttn(precision=PRECISION_OF[dtype]))
    calls = count_launches(monkeypatch, "16bit")
    ours = model(**inputs)[0]
    expected = kernel_launches(model)
    assert calls[0] == expected, f"{calls[0]} launches of the 16-bit kernels, expected {expected}"
    assert ours.dtype == dtype and torch.isfinite(ours).all()
    spread, error = rel_l2(stock_math, stock), rel_l2(ours, stock)
    print(f"{dtype} {config} B{batch} fused={fused}: stock math vs default {spread:.2e}, PictorAttn {error:.2e}")
    assert error <= YARDSTICK_FACTOR * spread + YARDSTICK_FLOOR, (
        f"rel L2 {error:.3e} to stock > {YARDSTICK_FACTOR} x stock's backend spread {spread:.3e} + {YARDSTICK_FLOOR}"
    )
    model.set_attn_processor(PictorAttn(precision="auto"))
    assert torch.equal(model(**inputs)[0], ours), 'precision="auto" on a 16-bit model differs from the 16-bit path'


@torch.no_grad()
def test_torch_compile_fullgraph_16bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 model with bf16 attention: everything but pictor's opaque ops stays f32 under inductor."""
    model = build_transformer(CONFIGS["d128"], device="cuda")
    model.set_attn_processor(PictorAttn(precision="bf16"))
    inputs = transformer_inputs(model, batch=1, latent_hw=(8, 8), text_len=16)
    calls = count_launches(monkeypatch, "16bit")
    eager = model(**inputs)[0]
    assert calls[0] == kernel_launches(model)
    compiled = torch.compile(model, fullgraph=True)
    traced = compiled(**inputs)[0]
    assert traced.dtype == torch.float32
    assert rel_l2(traced, eager) <= 1e-3
