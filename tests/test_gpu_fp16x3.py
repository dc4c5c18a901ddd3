"""The Hopper parity kernel (fp16x3 on wgmma) and its split prepass against float64.

Targets (issue 10): max-abs <= 2e-6 at N(0,1) on FLUX.2 shapes; v channels
spanning 1e-4..1e4 within 1e-5 of each channel's magnitude; q/k rows whose
norms span 1e-2..10 no worse than SDPA fp32's own error on the same inputs.
Outputs are NaN-poisoned before every launch; inputs are fresh random draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from pictor_diffusers.testing.references import attention_float64, random_qkv

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the fp16x3 kernel needs an sm_90 GPU (H100/H200)")


def _run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import plan_attention

    batch, heads, seq, head_dim = query.shape
    out = torch.full((batch, seq, heads * head_dim), float("nan"), device="cuda")
    return run(plan_attention(query, key, value, head_dim**-0.5, "fp16x3", torch.float32, out=out))


def _sdpa_fp32(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """SDPA fp32 (math backend, no TF32) as token-major `[B, N, H*D]`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    batch, heads, seq, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


@needs_hopper
@pytest.mark.parametrize(
    "shape",
    [(1, 24, 4608, 128), (1, 48, 4608, 128), (2, 24, 1536, 128), (1, 24, 4097, 128), (2, 5, 77, 128), (1, 3, 1, 128)],
    ids=lambda s: "B{}-H{}-N{}-D{}".format(*s),
)
def test_normal_inputs_within_2e6_of_float64(shape: tuple[int, int, int, int]) -> None:
    query, key, value = random_qkv(*shape, seed=sum(shape))
    out = _run(query, key, value)
    err = (out.double() - attention_float64(query, key, value)).abs().max().item()
    print(f"fp16x3 {shape} N(0,1) max_abs={err:.3e}")
    assert not out.isnan().any()
    assert err <= 2e-6


@needs_hopper
def test_value_channels_of_every_magnitude() -> None:
    """v channels spanning 1e-4..1e4 (an fp32 model's v is unbounded): each within 1e-5 of its magnitude."""
    query, key, value = random_qkv(1, 4, 1000, 128, seed=21)
    magnitude = torch.logspace(-4, 4, 128, device="cuda")
    value = value * magnitude
    out = _run(query, key, value)
    err = (out.double() - attention_float64(query, key, value)).abs().amax(dim=(0, 1)).view(4, 128)
    relative = (err / magnitude.double()).max().item()
    print(f"fp16x3 v channels 1e-4..1e4: max error / channel magnitude = {relative:.3e}")
    assert torch.isfinite(out).all() and relative <= 1e-5


@needs_hopper
def test_query_and_key_rows_of_every_norm() -> None:
    """q/k row norms spanning 1e-2..10 and v channels 1e-4..1e4: no worse than SDPA fp32's own error."""
    query, key, value = random_qkv(1, 4, 1000, 128, seed=22)
    norms = torch.logspace(-2, 1, 1000, device="cuda")
    query = query / query.norm(dim=-1, keepdim=True) * norms[torch.randperm(1000, device="cuda")][:, None]
    key = key / key.norm(dim=-1, keepdim=True) * norms[torch.randperm(1000, device="cuda")][:, None]
    value = value * torch.logspace(-4, 4, 128, device="cuda")
    reference = attention_float64(query, key, value)
    ours = (_run(query, key, value).double() - reference).abs().max().item()
    sdpa = (_sdpa_fp32(query, key, value).double() - reference).abs().max().item()
    print(f"fp16x3 wide q/k norms: max_abs={ours:.3e}, SDPA fp32 math={sdpa:.3e}")
    assert ours <= max(sdpa, 1e-9 * reference.abs().max().item())


@needs_hopper
def test_a_zero_head_and_tiny_and_huge_heads() -> None:
    """Per-head scales: an all-zero v head gives zeros; heads scaled by 1e-30 and 1e30 keep their accuracy."""
    query, key, value = random_qkv(1, 3, 300, 128, seed=23)
    value = value * torch.tensor([0.0, 1e-30, 1e30], device="cuda")[:, None, None]
    query = query * torch.tensor([1.0, 1e-20, 1e-3], device="cuda")[:, None, None]
    out = _run(query, key, value).view(1, 300, 3, 128)
    reference = attention_float64(query, key, value).view(1, 300, 3, 128)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    for head, magnitude in ((1, 1e-30), (2, 1e30)):
        err = (out[:, :, head].double() - reference[:, :, head]).abs().max().item() / magnitude
        assert err <= 2e-6, f"head {head}: error {err:.3e} relative to its magnitude"


@needs_hopper
@pytest.mark.parametrize("seq", [64, 1000])
def test_split_planes_hold_22_bits(seq: int) -> None:
    """hi + lo = x 2^e to 2^-22 relative; e puts each group's max |x| in [2^14, 2^15)."""
    from pictor_diffusers.cuda import nvrtc
    from pictor_diffusers.cuda.geometry import Geometry
    from pictor_diffusers.cuda.launch import split_planes
    from pictor_diffusers.cuda.pass_rows import split_variant

    query, key, value = random_qkv(2, 3, seq, 128, seed=seq)
    value = value * torch.logspace(-3, 3, 128, device="cuda")
    geometry = Geometry(6, seq, seq, seq, seq, 128, torch.float32, 3, 128**-0.5 / math.log(2.0))
    function = nvrtc.function(split_variant(128), query.device.index)
    pointers = (query.data_ptr(), key.data_ptr(), value.data_ptr())
    flat, colmax = split_planes(pointers, geometry, query.device.index, function)
    planes = flat.view(3, 2, 6, seq, 128)
    for index, tensor in enumerate((query, key, value)):
        groups = tensor.reshape(6, seq, 128)
        column_max = groups.abs().amax(dim=1)
        assert torch.equal(colmax[index].view(torch.float32), column_max)
        group_max = column_max if index == 2 else column_max.amax(dim=1, keepdim=True).expand(6, 128)
        scale = torch.exp2(14 - torch.floor(torch.log2(group_max)))[:, None, :]
        scaled = groups.double() * scale
        assert (scaled.abs().amax(dim=(1,)) < 2**15).all()
        joined = planes[index, 0].double() + planes[index, 1].double()
        bound = 2.0**-22 * scaled.abs() + 2.0**-25  # lo rounds to 11 bits, or to fp16's subnormal step
        assert ((joined - scaled).abs() <= bound).all(), f"tensor {index}: hi + lo is off"
