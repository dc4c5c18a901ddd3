"""`fused8.attention_8bit` on the CPU: the unfused route (torch prologue in bfloat16, then the 8-bit kernel's
twin), exactly; its custom op under `torch.compile(fullgraph=True)`; the errors it raises."""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers.fused8 import attention_8bit, fused_blocker
from pictor_diffusers.ops import attention
from pictor_diffusers.prologue import Segment, pack_head_major

HEAD_DIM = 128


def _segments(text: int, image: int, heads: int, batch: int, dtype: torch.dtype) -> list[Segment]:
    """Random projections `[B, n, H*128]` (image tokens as chunks of one fused projection) and RMSNorms."""
    generator = torch.Generator().manual_seed(text * 1000 + image)
    width = heads * HEAD_DIM

    def norm() -> torch.nn.RMSNorm:
        module = torch.nn.RMSNorm(HEAD_DIM, eps=1e-6)
        module.weight.data = torch.rand(HEAD_DIM, generator=generator) + 0.5
        return module

    fused = torch.randn(batch, image, 3 * width + 64, generator=generator).to(dtype)
    segments = [Segment(*fused[..., : 3 * width].chunk(3, dim=-1), norm(), norm())]
    if text:
        separate = [torch.randn(batch, text, width, generator=generator).to(dtype) for _ in range(3)]
        segments.insert(0, Segment(*separate, norm(), norm()))
    return segments


def _rope(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(seq, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seq)) * 6.3
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


CASES = {"double-stream": (21, 140, 2, 2), "single-stream": (0, 200, 3, 1)}
"""(text tokens, image tokens, heads, batch): sizes that are not multiples of the 64-row q blocks or 128-key
tiles."""


@torch.no_grad()
@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_route_is_the_prologue_then_the_twin(case: str, dtype: torch.dtype, with_rope: bool) -> None:
    text, image, heads, batch = CASES[case]
    segments = _segments(text, image, heads, batch, dtype)
    rope = _rope(text + image) if with_rope else None
    ours = attention_8bit(segments, HEAD_DIM, rope, "fp8")
    query, key, value = pack_head_major(segments, HEAD_DIM, rope, torch.bfloat16)
    expected = attention(query, key, value, out_dtype=torch.bfloat16, kernel="fp8")
    assert ours.dtype == torch.bfloat16 and ours.shape == (batch, text + image, heads * HEAD_DIM)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, expected)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
@torch.no_grad()
def test_compiled_op_is_one_node_equal_to_eager() -> None:
    segments = _segments(*CASES["double-stream"], torch.bfloat16)
    rope = _rope(sum(CASES["double-stream"][:2]))
    eager = attention_8bit(segments, HEAD_DIM, rope, "fp8")
    compiled = torch.compile(lambda s, r: attention_8bit(s, HEAD_DIM, r, "fp8"), fullgraph=True)
    try:
        out = compiled(segments, rope)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, eager)


def test_the_op_names_a_kernel_that_is_not_8_bit() -> None:
    segments = _segments(0, 10, 1, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="kernel='wgmma'"):
        attention_8bit(segments, HEAD_DIM, None, "wgmma")


def test_cpu_projections_are_not_fused() -> None:
    projections = [t for segment in _segments(0, 10, 1, 1, torch.bfloat16) for t in segment[:3]]
    weights, eps = [torch.ones(HEAD_DIM)] * 2, [1e-6] * 2
    assert "CUDA" in fused_blocker(projections, weights, [], eps)
