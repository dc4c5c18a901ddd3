"""The fused QK-norm / RoPE / head-major prologue kernel against its torch twin.

f32 outputs: within 2e-5 (relative to the largest value) of `pack_head_major_torch`.
16-bit outputs (the fast path): the torch twin's f32 result rounded once, i.e.
bitwise equal except where the two f32 results straddle a rounding boundary,
and never more than one 16-bit ulp (plus the f32 tolerance) away.
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers.cuda.launch import qkv_prologue_cuda
from pictor_diffusers.cuda.prologue_layout import prologue_layout, prologue_layout_problem
from pictor_diffusers.ops.prologue import pack_head_major_torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS, HEAD_DIM = 6, 128
INNER = HEADS * HEAD_DIM


def _rope(seq: int) -> list[torch.Tensor]:
    angles = torch.rand(seq, HEAD_DIM // 2, device="cuda") * 6.3
    return [angles.cos().repeat_interleave(2, -1).contiguous(), angles.sin().repeat_interleave(2, -1).contiguous()]


def _weights() -> list[torch.Tensor]:
    return [torch.rand(HEAD_DIM, device="cuda") + 0.5 for _ in range(4)]


def _separate(batch: int, tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.randn(batch, tokens, INNER, device="cuda").to(dtype) for _ in range(3)]


def _fused(batch: int, tokens: int, dtype: torch.dtype, extra: int = 0) -> list[torch.Tensor]:
    """Chunks of one `[B, n, 3*inner + extra]` projection, as fused and single-stream layers give."""
    fused = torch.randn(batch, tokens, 3 * INNER + extra, device="cuda").to(dtype)
    return list(fused[..., : 3 * INNER].chunk(3, dim=-1))


LAYOUTS = {
    "double-separate": lambda b, d: _separate(b, 21, d) + _separate(b, 333, d),
    "double-fused": lambda b, d: _fused(b, 21, d) + _fused(b, 333, d),
    "single-fused-mlp": lambda b, d: [t[:, :0] for t in _fused(b, 1, d)] + _fused(b, 354, d, extra=4 * INNER),
    "single-segment": lambda b, d: _fused(b, 355, d, extra=4 * INNER),
}


NAN_BITS = 0x7FC07FC0
"""NaN as float32, and both halves NaN as bfloat16 and float16."""


def _poison_allocator(numel: int) -> None:
    """Leave NaN (in every dtype) in the blocks the caching allocator hands out next."""
    for _ in range(3):
        torch.full((numel,), NAN_BITS, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_prologue_kernel_matches_torch(batch: int, dtype: torch.dtype, layout: str, with_rope: bool) -> None:
    projections = LAYOUTS[layout](batch, dtype)
    seq = sum(p.shape[1] for p in projections[::3])
    weights, eps = _weights()[: len(projections) * 2 // 3], [1e-6] * (len(projections) * 2 // 3)
    rope = _rope(seq) if with_rope else []
    assert prologue_layout_problem(projections, weights, rope, eps) is None
    _poison_allocator(batch * HEADS * seq * HEAD_DIM)
    fused = qkv_prologue_cuda(prologue_layout(projections, weights, rope, eps))
    reference = pack_head_major_torch(projections, weights, rope, eps)
    for name, ours, ref in zip("qkv", fused, reference, strict=True):
        assert ours.shape == (batch, HEADS, seq, HEAD_DIM) and ours.is_contiguous()
        assert not ours.isnan().any(), f"{name}: unwritten elements"
        err = (ours - ref).abs().max().item()
        assert err <= 2e-5 * max(1.0, ref.abs().max().item()), f"{name}: max-abs {err:.3e}"


def test_misaligned_layout_is_refused_and_the_op_falls_back_to_torch() -> None:
    """Views starting one element in cannot be read as 4-element vectors: torch computes them."""
    storage = torch.randn(1, 40, 3 * INNER + 1, device="cuda").to(torch.bfloat16)
    shifted = list(storage[..., 1:].chunk(3, dim=-1))
    projections = [t[:, :10] for t in shifted] + [t[:, 10:] for t in shifted]
    weights, eps = _weights(), [1e-6] * 4
    reason = prologue_layout_problem(projections, weights, [], eps)
    assert reason is not None and "aligned" in reason
    ours = torch.ops.pictor.qkv_prologue(projections, weights, [], eps)
    for got, ref in zip(ours, pack_head_major_torch(projections, weights, [], eps), strict=True):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES, ids=str)
def test_prologue_16bit_output_is_the_f32_result_rounded_once(
    in_dtype: torch.dtype, out_dtype: torch.dtype, layout: str, with_rope: bool
) -> None:
    projections = LAYOUTS[layout](2, in_dtype)
    seq = sum(p.shape[1] for p in projections[::3])
    weights, eps = _weights()[: len(projections) * 2 // 3], [1e-6] * (len(projections) * 2 // 3)
    rope = _rope(seq) if with_rope else []
    assert prologue_layout_problem(projections, weights, rope, eps) is None
    _poison_allocator(2 * HEADS * seq * HEAD_DIM)
    fused = qkv_prologue_cuda(prologue_layout(projections, weights, rope, eps), out_dtype)
    via_op = torch.ops.pictor.qkv_prologue(projections, weights, rope, eps, str(out_dtype).removeprefix("torch."))
    reference = pack_head_major_torch(projections, weights, rope, eps)
    for name, ours, op, ref in zip("qkv", fused, via_op, reference, strict=True):
        assert ours.dtype == out_dtype and ours.shape == (2, HEADS, seq, HEAD_DIM) and ours.is_contiguous()
        assert not ours.isnan().any(), f"{name}: unwritten elements"
        assert torch.equal(op, ours), f"{name}: the custom op did not run the kernel"
        rounded = ref.to(out_dtype)
        diff = (ours.float() - rounded.float()).abs()
        bound = ref.abs() * torch.finfo(out_dtype).eps + 2e-5 * max(1.0, ref.abs().max().item())
        assert (diff <= bound).all(), f"{name}: more than one {out_dtype} ulp off, max diff {diff.max().item():.3e}"
        differing = (ours != rounded).float().mean().item()
        print(f"{name} {in_dtype}->{out_dtype} {layout}: {differing:.2e} of elements not bitwise equal")
        assert differing <= 1e-3, f"{name}: {differing:.2e} of elements differ from the rounded torch result"
