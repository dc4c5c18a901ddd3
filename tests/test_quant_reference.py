"""The planned 8-bit attention's CPU twin (`quant_reference`) against float64 SDPA, and its quantisers.

Targets (the issue): cosine >= 0.9995 and rel L1 <= 3 x the bf16 path's rel L1 on the same inputs, for
N(0, 1) inputs, K with a 5-sigma channel offset, and peaky attention (q, k x4). Measured (torch 2.13 CPU,
B 1, H 1, D 128, N 1000 and 4608; cos / rel L1 as a multiple of the bf16 path's):

* planned scheme (int8 Q/K in 64-row / 128-key blocks, K smoothing, FP8 E4M3 P x448 and V per channel):
  normal 0.9993 / 10.3-10.5x, K offset 0.9993 / 4.2-4.7x, peaky 0.9978-0.9981 / 6.5-6.9x: misses both
  targets everywhere. E4M3 rounding of P alone, or of V alone, costs ~2.5% rel L1 (~7x bf16) when V is
  zero-mean iid, whatever the scales; so these are strict xfails (they fail the day the scheme passes).
* int8 Q/K per token + bf16 P·V: normal 0.99996 / 2.6x, K offset 0.99996 / 1.1x (met), peaky 0.9991 / 3.4-3.7x.
* with a 5-sigma V offset (outputs dominated by V's mean) the planned scheme meets both (1.1-1.3x; V smoothing
  0.16-0.27x), but a 14-bit P·V accumulator that is never promoted to f32 grows to 3.4x at N 4608 (in the
  per-k32-step model; truncated after every key, as the H200 behaves, far more: the last two tests).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache, partial

import pytest
import torch

import pictor_diffusers.ops.quant_reference as quant_reference
from pictor_diffusers.cuda.sources import read_source
from pictor_diffusers.ops.quant_reference import (
    FP8_MAX,
    INT8_PV_SCHEME,
    KERNEL_RESCALE_SLACK,
    KERNEL_SCHEME,
    QUANT_FLOOR,
    int8_fp8_attention,
    kernel_twin,
    quantize_fp8_blocks,
    quantize_fp8_channels,
    quantize_int8_blocks,
    smooth_k,
    to_e4m3,
    truncate_mantissa,
)
from pictor_diffusers.ops.reference import online_softmax_attention
from pictor_diffusers.testing.quant_study import bf16_path_attention, error_metrics, study_inputs
from pictor_diffusers.testing.references import attention_float64, rel_l2

COS_TARGET, L1_FACTOR = 0.9995, 3.0
SETS = ("normal", "k_offset", "peaky")
SEQS = (1000, 4608)  # 1000: not a multiple of the 64-row / 128-key blocks
# The planned scheme's measured (1 - cos, rel L1 / bf16 rel L1) per case: the emulation must stay within
# +-15% / +-10% of them, both ways (unquantised P, for one, drops rel L1 by 22% on normal and K offset).
MEASURED = {
    ("normal", 1000): (6.94e-4, 10.46),
    ("normal", 4608): (7.07e-4, 10.34),
    ("k_offset", 1000): (6.94e-4, 4.21),
    ("k_offset", 4608): (7.07e-4, 4.72),
    ("peaky", 1000): (1.87e-3, 6.89),
    ("peaky", 4608): (2.16e-3, 6.48),
}
PER_TOKEN_BF16_PV = partial(int8_fp8_attention, pv_format="bf16", q_block=1, k_block=1)
MISSES = "measured below the targets (see the module docstring)"


@cache
def case(kind: str, seq: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, float]:
    """((q, k, v) B1 H1 D128, their float64 attention, the bf16 path's rel L1), once per session."""
    qkv = study_inputs(kind, 1, 1, seq, 128, seed=seq)
    reference = attention_float64(*qkv)
    return qkv, reference, error_metrics(bf16_path_attention(*qkv), reference)["rel_l1"]


def score(scheme: Callable[..., torch.Tensor], kind: str, seq: int) -> tuple[float, float]:
    """(cosine, rel L1 / bf16 path's rel L1) of `scheme(q, k, v)` on the case."""
    qkv, reference, bf16_l1 = case(kind, seq)
    metrics = error_metrics(scheme(*qkv), reference)
    return metrics["cos"], metrics["rel_l1"] / bf16_l1


def cases(xfail: tuple[str, ...] = ()) -> list:
    """(set, N) params for SETS x SEQS; the sets in `xfail` are strict xfails."""
    marks = [pytest.mark.xfail(strict=True, reason=MISSES)]
    return [
        pytest.param(kind, seq, id=f"{kind}-N{seq}", marks=marks * (kind in xfail)) for kind in SETS for seq in SEQS
    ]


@pytest.mark.parametrize(("kind", "seq"), cases(xfail=SETS))
def test_planned_scheme_meets_targets(kind: str, seq: int) -> None:
    cos, l1_factor = score(int8_fp8_attention, kind, seq)
    assert cos >= COS_TARGET and l1_factor <= L1_FACTOR, f"cos {cos:.5f}, rel L1 {l1_factor:.2f} x bf16"


@pytest.mark.parametrize(("kind", "seq"), cases())
def test_planned_scheme_measured_bounds(kind: str, seq: int) -> None:
    """The emulation's regression alarm: errors as measured (MEASURED), neither better nor worse."""
    cos, l1_factor = score(int8_fp8_attention, kind, seq)
    measured_gap, measured_factor = MEASURED[kind, seq]
    assert 1 - cos == pytest.approx(measured_gap, rel=0.15), f"cos {cos:.5f}"
    assert l1_factor == pytest.approx(measured_factor, rel=0.10), f"rel L1 {l1_factor:.2f} x bf16"


@pytest.mark.parametrize(("kind", "seq"), cases(xfail=("peaky",)))
def test_per_token_int8_bf16_pv_meets_targets(kind: str, seq: int) -> None:
    cos, l1_factor = score(PER_TOKEN_BF16_PV, kind, seq)
    assert cos >= COS_TARGET and l1_factor <= L1_FACTOR, f"cos {cos:.5f}, rel L1 {l1_factor:.2f} x bf16"


@pytest.mark.parametrize("seq", SEQS)
def test_k_smoothing_needed_for_k_offset(seq: int) -> None:
    """Without smoothing the 5-sigma K offset eats the int8 range: measured 1.27x the rel L1, cos 0.9989."""
    cos, l1_factor = score(int8_fp8_attention, "k_offset", seq)
    raw_cos, raw_factor = score(partial(int8_fp8_attention, k_smoothing=False), "k_offset", seq)
    assert raw_factor >= 1.15 * l1_factor and raw_cos < cos


@pytest.mark.parametrize("kind", SETS)
def test_fp8_qk_worse_than_int8(kind: str) -> None:
    """E4M3 Q/K (3 mantissa bits) against int8 (7 bits): measured 1.37x (normal, K offset) to 2.3x (peaky)."""
    _, l1_factor = score(int8_fp8_attention, kind, 1000)
    cos_fp8, fp8_factor = score(partial(int8_fp8_attention, qk_format="fp8"), kind, 1000)
    assert fp8_factor >= 1.2 * l1_factor and cos_fp8 < COS_TARGET


@pytest.mark.parametrize("kind", SETS)
def test_row_p_scale_and_promoted_14_bit_accumulator(kind: str) -> None:
    """P relative to each tile's max is no worse (measured 0.95-1.0x); a 14-bit P·V accumulator promoted to f32
    every 128 keys costs nothing on these sets (measured 1.000x; the model truncates per k32 step, milder than
    the H200)."""
    _, l1_factor = score(int8_fp8_attention, kind, 4608)
    assert score(partial(int8_fp8_attention, p_scale="row"), kind, 4608)[1] <= 1.01 * l1_factor
    assert score(partial(int8_fp8_attention, pv_accum_bits=14), kind, 4608)[1] <= 1.01 * l1_factor


def test_v_offset_meets_targets_and_needs_promotion() -> None:
    """A 5-sigma V offset: the planned scheme meets the targets, V smoothing cuts rel L1 >= 3x (measured 6.8x),
    and an unpromoted 14-bit accumulator (the running sum of all tiles truncated) misses (measured 3.4x)."""
    plain = partial(int8_fp8_attention, v_smoothing=False)
    cos, l1_factor = score(plain, "v_offset", 4608)
    assert cos >= COS_TARGET and l1_factor <= L1_FACTOR
    assert score(partial(int8_fp8_attention, v_smoothing=True), "v_offset", 4608)[1] * 3 <= l1_factor
    assert score(partial(int8_fp8_attention, pv_accum_bits=14, pv_promote=False), "v_offset", 4608)[1] > L1_FACTOR


def test_row_p_scale_needs_promotion() -> None:
    q, k, v = study_inputs("normal", 1, 1, 8, 128, seed=0)
    with pytest.raises(ValueError, match="pv_promote"):
        int8_fp8_attention(q, k, v, p_scale="row", pv_promote=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layout_matches_online_softmax_attention(dtype: torch.dtype) -> None:
    """Token-major [B, Nq, H*D] float32 like the f32 reference, head by head (N 77: partial blocks, Nq != Nk)."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 77, 128, generator=generator).to(dtype)
    k, v = (torch.randn(2, 3, 200, 128, generator=generator).to(dtype) for _ in range(2))
    out = int8_fp8_attention(q, k, v)
    expected = online_softmax_attention(q, k, v, 128**-0.5)
    assert out.dtype == torch.float32 and out.shape == expected.shape == (2, 77, 384) and out.is_contiguous()
    for head in range(3):
        part = slice(128 * head, 128 * (head + 1))
        assert error_metrics(out[..., part], expected[..., part])["cos"] > 0.998, f"head {head}"
    assert error_metrics(int8_fp8_attention(q, k, v, scale=0.3), online_softmax_attention(q, k, v, 0.3))["cos"] > 0.998


def test_int8_blocks_scales_round_trip_and_clamp() -> None:
    x = torch.randn(2, 3, 200, 128, generator=torch.Generator().manual_seed(1))  # 200: last block of 8 rows
    x[0, 1, 70, 5] = 50.0  # only block 1 of (0, 1) sees it
    x[1, 2, 192:] = 0.0  # an all-zero block: codes 0, no NaN
    codes, scales = quantize_int8_blocks(x, 64, extra_scale=0.25)
    assert codes.dtype == torch.int8 and scales.shape == (2, 3, 4) and scales.dtype == torch.float32
    for block in range(4):
        rows = x[:, :, 64 * block : 64 * (block + 1)]
        absmax = rows.abs().amax(dim=(2, 3))
        torch.testing.assert_close(scales[:, :, block], absmax.clamp_min(QUANT_FLOOR) / 127 * 0.25)
        block_codes = codes[:, :, 64 * block : 64 * (block + 1)].int()
        assert block_codes.abs().amax(dim=(2, 3))[absmax > 0].eq(127).all(), "absmax -> ±127"
    assert scales[0, 1, 1] == 50.0 / 127 * 0.25 and scales[0, 1, 0] < 5 / 127
    assert codes.min() >= -127 and not codes[1, 2, 192:].any() and torch.isfinite(scales).all()
    step = scales.repeat_interleave(64, dim=2)[:, :, :200, None] / 0.25
    assert ((codes.float() * step - x).abs() <= step / 2 * (1 + 1e-6)).all(), "error over half a step"


def test_quantisers_use_the_prepass_arithmetic() -> None:
    """Codes are x * (MAX / absmax) in f32 with MAX / absmax one IEEE division, as quantize_qkv8.cu computes them
    (with its absmax floor). x divided by the scale rounds some ties the other way, which on the peaky set moved
    the twin's LSE by up to 0.13 (9 of 9216 rows at 4608 keys) and its output by 2.1e-3 relative L2; so does
    torch's `127 / absmax` (reciprocal, then product: on the H200 the prepass's q codes differed from that
    twin's on ~1e-4 of codes at H24 N4608)."""
    floor = re.search(r"#define QZ_FLOOR ([0-9.e+-]+)f", read_source("quantize_qkv8.cu")).group(1)
    assert QUANT_FLOOR == float(floor)
    q, k, v = study_inputs("peaky", 1, 2, 4608, 128, seed=4610)
    flips = twice_rounded = 0
    for x, block in ((q, 64), (smooth_k(k)[0], 128)):
        codes, scales = quantize_int8_blocks(x, block)
        absmax = x.abs().view(1, 2, -1, block * 128).amax(dim=-1).repeat_interleave(block, dim=2)[..., None]
        assert torch.equal(codes.float(), torch.round(x * (torch.full_like(absmax, 127.0) / absmax)))
        flips += (torch.round(x / scales.repeat_interleave(block, dim=2)[..., None]) != codes.float()).sum().item()
        twice_rounded += (torch.round(x * (127 / absmax)) != codes.float()).sum().item()
    assert flips > 0, "on these inputs x / scale differs from the kernel's codes somewhere"
    assert twice_rounded > 0, "on these inputs torch's 127 / absmax differs from the kernel's codes somewhere"
    v = v.bfloat16().float()  # the kernel's inputs are 16-bit
    v_codes = quantize_fp8_channels(v)[0].float()
    v_absmax = v.abs().amax(dim=2, keepdim=True)
    assert torch.equal(v_codes, to_e4m3(v * (torch.full_like(v_absmax, FP8_MAX) / v_absmax)).float())
    assert (to_e4m3(v * (FP8_MAX / v_absmax)).float() != v_codes).sum().item() > 0, "448 / absmax flips none here"


def test_fp8_channels_and_blocks() -> None:
    x = torch.randn(1, 2, 300, 128, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 100, 128)
    codes, scales = quantize_fp8_channels(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (1, 2, 1, 128)
    torch.testing.assert_close(scales, x.abs().amax(dim=2, keepdim=True) / FP8_MAX)
    assert codes.float().abs().amax(dim=2).eq(FP8_MAX).all(), "each channel's absmax -> 448 exactly"
    code_values = codes.float()
    error = (code_values * scales - x).abs()
    normal = code_values.abs() >= 2**-6
    assert (error[normal] <= 2**-4 * x.abs()[normal] * (1 + 1e-5)).all(), "normals: over 2^-4 relative"
    assert (error[~normal] <= 2**-10 * scales.expand_as(x)[~normal] * (1 + 1e-5)).all(), "subnormals: over half a step"
    block_codes, block_scales = quantize_fp8_blocks(x, 128)
    assert block_scales.shape == (1, 2, 3) and block_codes.float().abs().amax(dim=(2, 3)).eq(FP8_MAX).all()
    assert to_e4m3(torch.tensor([1e4, -1e4, 0.3])).float().tolist() == [448.0, -448.0, 0.3125], "saturate, round"


def test_truncate_mantissa() -> None:
    x = torch.tensor([1 + 2**-13 + 2**-20, -(1 + 2**-13 + 2**-20), 3.0, 0.0])
    assert truncate_mantissa(x, 14).tolist() == [1 + 2**-13, -(1 + 2**-13), 3.0, 0.0]


def test_smooth_k_leaves_softmax_unchanged() -> None:
    q, k, v = study_inputs("k_offset", 1, 2, 300, 128, seed=4)
    smoothed, mean = smooth_k(k.double())
    assert mean.shape == (1, 2, 1, 128) and smoothed.mean(dim=2).abs().max() < 1e-5
    assert mean.abs().max() > 5, "the offset is what gets removed"
    shift = (attention_float64(q.double(), smoothed.double(), v) - attention_float64(q, k, v)).abs().max().item()
    assert shift < 1e-5, shift  # the f32 subtraction's rounding; the softmax itself is invariant


@pytest.mark.parametrize("offset", [0.0, 2.0])
def test_twin_lse_merges_key_shards(offset: float) -> None:
    """Ring attention merges per-shard results by their LSEs; each shard smooths K by its own mean, so each LSE
    must carry its own q . mean back. Shards with opposite mean offsets: the merge keeps one call's error
    (without the shift it was 0.62 relative L2 at offset 2)."""
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(1, 2, 256, 128, generator=generator).bfloat16()
    k = torch.randn(1, 2, 512, 128, generator=generator)
    k[:, :, :256] += offset
    k[:, :, 256:] -= offset
    k, v = k.bfloat16(), torch.randn(1, 2, 512, 128, generator=generator).bfloat16()
    exact = attention_float64(q, k, v)
    (out_a, lse_a), (out_b, lse_b) = (
        kernel_twin(q, k[:, :, keys], v[:, :, keys], 128**-0.5, return_lse=True)
        for keys in (slice(0, 256), slice(256, 512))
    )
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a, weight_b = (torch.exp(part - lse).repeat_interleave(128, dim=-1) for part in (lse_a, lse_b))
    merged = out_a * weight_a + out_b * weight_b
    single = kernel_twin(q, k, v, 128**-0.5)
    assert rel_l2(merged, exact) <= 1.2 * rel_l2(single, exact)


@pytest.mark.parametrize("head_dim", [64, 129], ids=lambda d: f"D{d}")
def test_the_cpu_twin_refuses_what_the_kernel_refuses(head_dim: int) -> None:
    """On CPU `attention(kernel="fp8")` runs the kernel's twin, and refuses a head_dim the kernel has no build for."""
    from pictor_diffusers import attention

    q, k, v = (torch.randn(1, 2, 40, head_dim, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match=rf"kernel='fp8' takes head_dim \(128,\), got head_dim={head_dim}"):
        attention(q, k, v, kernel="fp8")


def test_lagging_reference_max_never_saturates_p() -> None:
    """Logits that grow from tile to tile by less than the slack: the reference max lags the true one by up to
    2 (log2), so P reaches 4 before rounding and must be scaled by 448 / 4 to stay within E4M3's 448. Measured:
    rel L2 to float64 3.90e-2 with slack 2, 3.73e-2 without; scaling by 448 instead clamps P and gives 0.24."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 200, 128, generator=generator)
    k = torch.randn(1, 2, 1024, 128, generator=generator) * torch.linspace(1.0, 2.5, 1024).view(1, 1, -1, 1)
    v = torch.randn(1, 2, 1024, 128, generator=generator)
    exact = attention_float64(q, k, v)
    lagging = rel_l2(int8_fp8_attention(q, k, v, rescale_slack=2.0), exact)
    assert lagging <= 1.1 * rel_l2(int8_fp8_attention(q, k, v), exact)


def test_rounded_row_sums_normalise_what_p_v_weighs() -> None:
    """With l the sum of the rounded P (the kernel's row-sum wgmma), constant V comes out exactly; with l from the
    f32 P, off by P's rounding (measured: 1.2e-7 and 5.8e-3 at the most)."""
    generator = torch.Generator().manual_seed(12)
    q, k = (torch.randn(1, 2, 100, 128, generator=generator) for _ in range(2))
    v = torch.full((1, 2, 300, 128), 0.75)
    k = torch.cat([k, torch.randn(1, 2, 200, 128, generator=generator)], dim=2)
    rounded = int8_fp8_attention(q, k, v, row_sum="rounded")
    assert (rounded - 0.75).abs().max().item() <= 1e-6
    assert (int8_fp8_attention(q, k, v) - 0.75).abs().max().item() >= 1e-4


def test_kernel_twin_runs_the_kernel_scheme() -> None:
    """`kernel_twin`, with and without key_lens, is `int8_fp8_attention` with F8_SLACK (read from the kernel) and
    rounded row sums, bit for bit; and each of the two options changes the result (so the check is not vacuous:
    K grows along the keys, the reference max lags, and l of the rounded P differs from the f32 one)."""
    slack = float(re.search(r"#define F8_SLACK ([0-9.]+)f", read_source("pv_e4m3.cuh")).group(1))
    generator = torch.Generator().manual_seed(13)
    q = torch.randn(2, 2, 70, 128, generator=generator)
    k = torch.randn(2, 2, 600, 128, generator=generator) * torch.linspace(1.0, 2.5, 600).view(1, 1, -1, 1)
    v = torch.randn(2, 2, 600, 128, generator=generator)
    scale = 128**-0.5
    kernel = partial(int8_fp8_attention, scale=scale, return_lse=True, rescale_slack=slack, row_sum="rounded")
    out, lse = kernel_twin(q, k, v, scale, return_lse=True)
    want_out, want_lse = kernel(q, k, v)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out, lse = kernel_twin(q, k, v, scale, return_lse=True, key_lens=torch.tensor([600, 300]))
    want_out, want_lse = kernel(q[1:], k[1:, :, :300], v[1:, :, :300])
    assert torch.equal(out[1:], want_out) and torch.equal(lse[1:], want_lse)
    for other in ({"rescale_slack": 0.0}, {"row_sum": "exact"}):
        assert not torch.equal(kernel(q, k, v, **other)[0], kernel(q, k, v)[0]), other


def test_reference_max_lags_by_up_to_the_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the kernel rounds to E4M3 (the P each tile hands `to_e4m3`): with slack 2 on logits that grow along the
    keys, some P pass 112 * 2 (the reference max lagged by more than one binade) and none passes 448."""
    rounded_p, real = [], quant_reference.to_e4m3

    def spy(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] == 70:  # P [B, H, Nq, keys]; V's codes are [B, H, Nk, D]
            rounded_p.append(x.amax().item())
        return real(x)

    monkeypatch.setattr(quant_reference, "to_e4m3", spy)
    generator = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 70, 128, generator=generator)
    k = torch.randn(1, 2, 600, 128, generator=generator) * torch.linspace(1.0, 2.5, 600).view(1, 1, -1, 1)
    v = torch.randn(1, 2, 600, 128, generator=generator)
    int8_fp8_attention(q, k, v, **KERNEL_SCHEME)
    assert len(rounded_p) == 5 and 2 * FP8_MAX / 2**KERNEL_RESCALE_SLACK < max(rounded_p) <= FP8_MAX, rounded_p


def test_kernel_scheme_needs_per_tile_promotion_on_v_offset() -> None:
    """The kernel's scheme on the v_offset set (4608 keys) with the FP8 wgmma's ~14-bit accumulator modelled
    (`pv_accum_bits=14`, truncated after each k32 step). Promoted to f32 per 128-key tile, as the kernel does
    since 2e09ac6, it stays on the twin (measured 9.7e-5 rel L2; 1.06x the twin's 1.0e-3 from float64); summed
    over all tiles, as before, O shrinks (gain 0.997) and drifts 3.2e-3 from the twin (3.8x the twin's error
    from float64). The model is milder than the H200: the one-level kernel was 8.4e-2 from the twin there."""
    (q, k, v), reference, _ = case("v_offset", 4608)
    twin = kernel_twin(q, k, v, 128**-0.5)
    run = partial(int8_fp8_attention, q, k, v, 128**-0.5, pv_accum_bits=14, **KERNEL_SCHEME)
    promoted, one_level = run(), run(pv_promote=False)
    gain = ((one_level * twin).sum() / (twin * twin).sum()).item()
    assert rel_l2(promoted, twin) <= 3e-4
    assert rel_l2(one_level, twin) >= 2e-3 and gain < 0.999, gain
    assert rel_l2(promoted, reference) <= 1.1 * rel_l2(twin, reference)
    assert rel_l2(one_level, reference) >= 2 * rel_l2(twin, reference)


def test_per_key_14_bit_truncation_reproduces_the_one_level_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncating the FP8 wgmma's accumulator to 14 bits after every key (not every k32 step) reproduces the H200:
    the one-level kernel was 8.4e-2 from the twin at 4608 keys on v_offset (model: 8.5e-2, 256 query rows), far
    over test_gpu_fp8's 8e-3 bound; promoted per 128-key tile, the model stays 6.8e-4 from the twin."""

    def per_key(p: torch.Tensor, v: torch.Tensor, bits: int | None, total: torch.Tensor) -> torch.Tensor:
        for key in range(p.shape[-1]):
            total = truncate_mantissa(total + p[..., key : key + 1] @ v[..., key : key + 1, :], bits)
        return total

    q, k, v = study_inputs("v_offset", 1, 1, 4608, 128, seed=4608)
    q = q[:, :, :256]
    twin = kernel_twin(q, k, v, 128**-0.5)
    monkeypatch.setattr(quant_reference, "_tile_pv", per_key)
    run = partial(int8_fp8_attention, q, k, v, 128**-0.5, pv_accum_bits=14, **KERNEL_SCHEME)
    assert rel_l2(run(pv_promote=False), twin) >= 5e-2
    assert rel_l2(run(), twin) <= 2e-3


def test_int8_kernel_twin_runs_the_u8_scheme() -> None:
    """`kernel_twin(kernel="int8")`, with and without key_lens, is `int8_fp8_attention` in `INT8_PV_SCHEME`, whose
    slack is the kernel's (pv_u8.cuh's F8_SLACK), bit for bit."""
    slack = float(re.search(r"#define F8_SLACK ([0-9.]+)f", read_source("pv_u8.cuh")).group(1))
    assert INT8_PV_SCHEME["rescale_slack"] == slack
    generator = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(2, 2, n, 128, generator=generator) for n in (70, 600, 600))
    scale = 128**-0.5
    out, lse = kernel_twin(q, k, v, scale, return_lse=True, kernel="int8")
    want_out, want_lse = int8_fp8_attention(q, k, v, scale, return_lse=True, **INT8_PV_SCHEME)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    out = kernel_twin(q, k, v, scale, key_lens=torch.tensor([600, 300]), kernel="int8")
    assert torch.equal(out[:1], int8_fp8_attention(q[:1], k[:1], v[:1], scale, **INT8_PV_SCHEME))
    want = int8_fp8_attention(q[1:], k[1:, :, :300], v[1:, :, :300], scale, **INT8_PV_SCHEME)
    assert torch.equal(out[1:], want)
    assert not torch.equal(out, kernel_twin(q, k, v, scale, key_lens=torch.tensor([600, 300])))
