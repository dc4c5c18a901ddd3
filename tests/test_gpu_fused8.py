"""The fused 8-bit prologue (`PROLOGUE8`: FLUX projections -> the 8-bit kernel's codes) on the GPU.

Truth: the unfused route, the prologue kernel writing bfloat16 then the 8-bit prepass. The fused build runs
the prologue's f32 operations in its order and rounds to bfloat16 the same way, so every code, scale and
shift must be bitwise equal, and the attention output with them. Allocations are NaN-poisoned first.
"""

from __future__ import annotations

import math

import pytest
import torch
from launch_counts import count_launches
from test_gpu_prologue import LAYOUTS, _poison_allocator, _rope, _weights

from pictor_diffusers import PictorAttn, fused8, launch
from pictor_diffusers.fused8 import attention_8bit, fused_blocker
from pictor_diffusers.geometry import Geometry
from pictor_diffusers.launch import cannot_run, qkv_prologue_cuda
from pictor_diffusers.ops import attention
from pictor_diffusers.prologue import Segment
from pictor_diffusers.quantized import quantize, quantize_projections, workspace_layout
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, transformer_inputs
from pictor_diffusers.testing.references import attention_float64
from pictor_diffusers.validation import prologue_layout

pytestmark = pytest.mark.gpu

HEADS, HEAD_DIM = 6, 128
SCALE_LOG2 = HEAD_DIM**-0.5 / math.log(2.0)


def _skip_unless_runs() -> None:
    reason = cannot_run("fp8", *(torch.empty(1, 1, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16),) * 3)
    if reason is not None:
        pytest.skip(reason)


def _arguments(layout: str, batch: int, dtype: torch.dtype, with_rope: bool) -> tuple[list, list, list, list]:
    projections = LAYOUTS[layout](batch, dtype)
    seq = sum(p.shape[1] for p in projections[::3])
    count = len(projections) * 2 // 3
    return projections, _weights()[:count], _rope(seq) if with_rope else [], [1e-6] * count


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_codes_equal_prologue_then_prepass(batch: int, dtype: torch.dtype, layout: str, with_rope: bool) -> None:
    _skip_unless_runs()
    arguments = _arguments(layout, batch, dtype, with_rope)
    plan = prologue_layout(*arguments)
    assert plan is not None and fused_blocker(*arguments) is None
    seq = plan.seq
    g = Geometry(batch * HEADS, seq, seq, seq, seq, HEAD_DIM, torch.bfloat16, HEADS, SCALE_LOG2)
    sizes = workspace_layout(g.planes, seq, seq)
    _poison_allocator(sum(size for _, size in sizes.values()))
    fused, _ = quantize_projections(plan, g)
    q, k, v = qkv_prologue_cuda(plan, torch.bfloat16)
    _poison_allocator(sum(size for _, size in sizes.values()))
    unfused, _ = quantize((q.data_ptr(), k.data_ptr(), v.data_ptr()), g, q.device.index)
    differing = {}
    for name, (offset, size) in sizes.items():
        count = (fused[offset : offset + size] != unfused[offset : offset + size]).sum().item()
        if count:
            differing[name] = f"{count} of {size} bytes"
    assert not differing, f"differ from prologue then prepass: {differing}"


@torch.no_grad()
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_equals_the_unfused_route_and_float64(layout: str) -> None:
    _skip_unless_runs()
    projections, weights, rope, eps = _arguments(layout, 2, torch.bfloat16, True)
    norms = [torch.nn.RMSNorm(HEAD_DIM, eps=1e-6).cuda() for _ in weights]
    for norm, weight in zip(norms, weights, strict=True):
        norm.weight.data = weight
    segments = [
        Segment(*projections[i : i + 3], *norms[2 * i // 3 : 2 * i // 3 + 2]) for i in range(0, len(projections), 3)
    ]
    fused = attention_8bit(segments, HEAD_DIM, tuple(rope), "fp8")
    q, k, v = qkv_prologue_cuda(prologue_layout(projections, weights, rope, eps), torch.bfloat16)
    unfused = attention(q, k, v, kernel="fp8")
    assert torch.equal(fused, unfused), "fused and unfused 8-bit routes differ"
    exact = attention_float64(q, k, v)
    cos = torch.nn.functional.cosine_similarity(fused.double().flatten(), exact.flatten(), dim=0).item()
    assert cos >= 0.998, f"cosine to float64 {cos:.5f}"


@torch.no_grad()
def test_misaligned_projections_take_the_unfused_route() -> None:
    """Views one element in cannot be read 16 bytes at a time: the prologue kernel and prepass serve them."""
    _skip_unless_runs()
    storage = torch.randn(1, 300, 3 * HEADS * HEAD_DIM + 8, device="cuda").to(torch.bfloat16)
    projections = list(storage[..., 4 : 4 + 3 * HEADS * HEAD_DIM].chunk(3, dim=-1))
    weights, eps = _weights()[:2], [1e-6] * 2
    reason = fused_blocker(projections, weights, [], eps)
    assert reason is not None and "aligned" in reason
    norms = [torch.nn.RMSNorm(HEAD_DIM, eps=1e-6).cuda() for _ in range(2)]
    for norm, weight in zip(norms, weights, strict=True):
        norm.weight.data = weight
    ours = attention_8bit([Segment(*projections, *norms)], HEAD_DIM, None, "fp8")
    q, k, v = qkv_prologue_cuda(prologue_layout(projections, weights, [], eps), torch.bfloat16)
    assert torch.equal(ours, attention(q, k, v, kernel="fp8"))


@torch.no_grad()
def test_processor_takes_the_fused_route_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attention of a tiny FLUX.2 goes through the fused launches, and the model output equals the one
    with fusion switched off."""
    _skip_unless_runs()
    config = {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32, 32, 32, 32)}
    model = build_transformer(config, device="cuda", dtype=torch.bfloat16)
    inputs = transformer_inputs(model, batch=2, latent_hw=(12, 10), text_len=33)
    model.set_attn_processor(PictorAttn(precision="fp8"))
    fused_calls, original = [0], launch.attention_from_projections_cuda

    def counting(*args: object) -> torch.Tensor:
        fused_calls[0] += 1
        return original(*args)

    monkeypatch.setattr(fused8, "attention_from_projections_cuda", counting)
    kernels = count_launches(monkeypatch, "8bit")
    fused = model(**inputs)[0]
    modules = model.config.num_layers + model.config.num_single_layers
    assert fused_calls[0] == modules and kernels[0] == modules
    monkeypatch.setattr(fused8, "projections_blocker", lambda layout: "switched off by the test")
    unfused = model(**inputs)[0]
    assert fused_calls[0] == modules and kernels[0] == 2 * modules
    assert torch.isfinite(fused).all() and torch.equal(fused, unfused)
