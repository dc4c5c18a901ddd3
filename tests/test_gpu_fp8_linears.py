"""PictorAttn on FLUX.2 transformers whose block Linear layers torchao quantised to fp8.

The yardstick is what fp8 linears do to stock itself: the distance between stock with fp8
linears and stock with bf16 linears. Pictor on the fp8 model must land within half of that
distance (plus its own attention error on the bf16 model) of stock on the same fp8 model.
Projections are run as modules, never through their `.weight`, so a tensor subclass
weight is used as torchao meant; fused projections are fused before quantising.
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.fp8_linears import quantize_block_linears, torchao_available
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not torchao_available(), reason="needs torchao (pip install 'pictor-diffusers[ao]')"),
]

CONFIG = {
    **TINY_CONFIG,
    "in_channels": 32,
    "attention_head_dim": 128,
    "num_attention_heads": 2,
    "joint_attention_dim": 64,
    "axes_dims_rope": (32, 32, 32, 32),
}
"""head_dim 128 (the 16-bit kernels' and the fp8 kernel's), every Linear width a multiple of 16."""


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def forward(model: torch.nn.Module, inputs: dict, processor: PictorAttn | None, compile_model: bool) -> torch.Tensor:
    if processor is None:
        set_stock_processors(model)
    else:
        model.set_attn_processor(processor)
    torch._dynamo.reset()
    runner = torch.compile(model, fullgraph=True, dynamic=False) if compile_model else model
    return runner(**inputs)[0]


@torch.no_grad()
@pytest.mark.skipif(not fp8_capable(), reason="fp8 linears need compute capability 8.9+")
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("image", [(16, 16), (9, 13)], ids=["256tok", "117tok"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_pictor_on_fp8_linears_eager(precision: str, image: tuple[int, int], fused: bool) -> None:
    model = build_transformer(CONFIG, device="cuda", dtype=torch.bfloat16)
    if fused:
        model.fuse_qkv_projections()
    inputs = transformer_inputs(model, batch=2, latent_hw=image, text_len=24)
    stock_bf16 = forward(model, inputs, None, False)
    pictor_bf16 = forward(model, inputs, PictorAttn(precision=precision), False)
    assert quantize_block_linears(model) > 0
    stock_fp8 = forward(model, inputs, None, False)
    pictor_fp8 = forward(model, inputs, PictorAttn(precision=precision), False)
    assert torch.isfinite(pictor_fp8).all()
    linears_effect = rel_l2(stock_fp8, stock_bf16)
    assert linears_effect > 0, "quantisation changed nothing: the Linear layers were not swapped"
    bound = 0.5 * linears_effect + 2 * rel_l2(pictor_bf16, stock_bf16)
    assert rel_l2(pictor_fp8, stock_fp8) <= bound


@torch.no_grad()
@pytest.mark.skipif(not fp8_capable(), reason="fp8 linears need compute capability 8.9+")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_pictor_on_fp8_linears_compiled_fullgraph(precision: str) -> None:
    model = build_transformer(CONFIG, device="cuda", dtype=torch.bfloat16)
    model.fuse_qkv_projections()
    quantize_block_linears(model)
    inputs = transformer_inputs(model, batch=1, latent_hw=(9, 13), text_len=24)
    eager_error = rel_l2(
        forward(model, inputs, PictorAttn(precision=precision), False), forward(model, inputs, None, False)
    )
    stock = forward(model, inputs, None, True)
    compiled = forward(model, inputs, PictorAttn(precision=precision), True)
    assert torch.isfinite(compiled).all()
    assert rel_l2(compiled, stock) <= 2 * eager_error + 1e-3


def test_a_gpu_without_fp8_units_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_transformer(CONFIG, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match=r"\(8, 0\)"):
        quantize_block_linears(model)
