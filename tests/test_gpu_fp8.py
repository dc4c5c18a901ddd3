"""The 8-bit Hopper kernels (`kernel="fp8"`: E4M3 P.V; `kernel="int8"`: u8 x int8 P.V) and their quantising
prepass.

Truths: the prepass against torch's quantisers (`quant_reference`); the kernel against its torch twin on the same
quantisation (`quant_reference.kernel_twin`: a kernel bug shows as an error far above the twin's own
rounding noise), and against float64 with the accuracy the scheme has on N(0, 1) inputs (measured on the H200:
cos 0.9992, rel L1 3.5e-2 to 3.9e-2 for "fp8"). Outputs are NaN-poisoned before the launch; inputs are fresh
draws. The tests of both kernels are parametrized over `KERNELS`; `test_gpu_int8_pv.py` holds the int8 scheme's
own prepass and accuracy tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from launch_counts import count_launches

from pictor_diffusers import PictorAttn, attention
from pictor_diffusers.cuda import nvrtc
from pictor_diffusers.cuda.geometry import Geometry, Window
from pictor_diffusers.cuda.launch import run
from pictor_diffusers.cuda.pass_rows import quantize_variant
from pictor_diffusers.cuda.plan import cannot_run, plan_attention
from pictor_diffusers.cuda.quantized import quantize, workspace_layout
from pictor_diffusers.ops.attention import windowed_attention
from pictor_diffusers.ops.quant_reference import kernel_twin, quantize_fp8_channels, quantize_int8_blocks, smooth_k
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, transformer_inputs
from pictor_diffusers.testing.quant_study import error_metrics, study_inputs
from pictor_diffusers.testing.references import attention_float64, lse_float64, random_qkv

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
KERNELS = ["fp8", "int8"]
# (B, H, Nq, Nk): FLUX.2 at 512² / 1024²; odd sizes, not multiples of the 64-row q blocks or 128-key tiles; Nq != Nk.
SHAPES = [(1, 24, 4608, 4608), (2, 3, 1536, 1536), (2, 3, 77, 77), (1, 4, 1000, 4097), (2, 2, 300, 129), (1, 2, 1, 1)]
TWIN_REL_L2 = {"fp8": 8e-3, "int8": 3e-3}
"""Kernel vs twin: the same quantisation, so only exp2's approximation, f32 summation order, the P codes it
flips at rounding ties and (fp8) the FP8 wgmma's ~14-bit adds within a key tile differ. fp8, measured on the
H200 with the twin's one-division quantisers: 1.7e-3 to 2.2e-3 at 4608 and 16896 keys (3.5e-3 to 4.1e-3 while
the twin divided twice; 8.4e-2 and 0.26 on v_offset before P.V was promoted per tile). int8 (exact integer
P.V), on an H100: 1.6e-3 to 1.7e-3 with bf16 outputs, 4.4e-4 to 5.4e-4 with fp16 (the output's rounding)."""
FLOAT64_COS, FLOAT64_REL_L1 = 0.998, 0.06
LOG2E = 1.0 / math.log(2.0)


def _id(value: object) -> str:
    if isinstance(value, tuple):
        return "B{}-H{}-Nq{}-Nk{}".format(*value)
    return str(value).removeprefix("torch.")


def qkv(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    batch, heads, seq_q, seq_k = shape
    q = random_qkv(batch, heads, seq_q, 128, seed=seed)[0].to(dtype)
    k, v = (t.to(dtype) for t in random_qkv(batch, heads, seq_k, 128, seed=seed + 1)[1:])
    return q, k, v


def skip_unless_runs(*tensors: torch.Tensor, kernel: str = "fp8") -> None:
    reason = cannot_run(kernel, *tensors)
    if reason is not None:
        pytest.skip(reason)


def poisoned_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str, **kwargs: object) -> torch.Tensor:
    batch, heads, seq_q, head_dim = q.shape
    out = torch.full((batch, seq_q, heads * head_dim), float("nan"), dtype=q.dtype, device=q.device)
    return run(plan_attention(q, k, v, head_dim**-0.5, kernel, q.dtype, out=out, **kwargs))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_kernel_against_twin_and_float64(shape: tuple[int, int, int, int], dtype: torch.dtype, kernel: str) -> None:
    q, k, v = qkv(shape, dtype, seed=sum(shape))
    skip_unless_runs(q, k, v, kernel=kernel)
    out = poisoned_call(q, k, v, kernel).double()
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison) or non-finite"
    twin = kernel_twin(q, k, v, 128**-0.5, kernel=kernel).double()
    twin_gap = error_metrics(out, twin)["rel_l2"]
    exact = error_metrics(out, attention_float64(q, k, v))
    print(f"{kernel} {_id(shape)} {_id(dtype)}: vs twin rel_l2 {twin_gap:.2e}; vs float64 {exact}")
    assert twin_gap <= TWIN_REL_L2[kernel]
    if shape[3] > 1:  # one key: the output is v itself, up to E4M3 rounding of v
        assert exact["cos"] >= FLOAT64_COS and exact["rel_l1"] <= FLOAT64_REL_L1


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_lse_against_float64_and_twin(dtype: torch.dtype, kernel: str) -> None:
    """K with a per-channel offset: smoothing takes q . mean off each logit, and the LSE must add it back
    (ring attention merges partial results by their LSEs). Bound: the twin's own LSE error on these inputs
    (measured on CPU: 3.9e-3 at N(0,1), 4.3e-3 with the offset; 3 before the shift was added back). Kernel vs
    twin: both sum the rounded P, so a P code that exp2's approximation flips at a rounding tie moves l
    (measured on the H200: 2.4e-3 here while the twin divided twice; 3.1e-4 to 1.3e-3 at 4608 and 16896 keys
    since)."""
    q, k, v = qkv((2, 3, 300, 1000), dtype, seed=5)
    k = (k.float() + 3.0 * torch.randn(2, 3, 1, 128, device=k.device)).to(dtype)
    skip_unless_runs(q, k, v, kernel=kernel)
    out, lse = attention(q, k, v, kernel=kernel, return_lse=True)
    twin_out, twin_lse = kernel_twin(q, k, v, 128**-0.5, return_lse=True, kernel=kernel)
    assert lse.shape == (2, 300, 3) and lse.dtype == torch.float32
    exact_gap, twin_gap = (lse.double() - lse_float64(q, k)).abs().max().item(), (lse - twin_lse).abs().max().item()
    out_gap = error_metrics(out.double(), twin_out.double())["rel_l2"]
    print(f"{kernel} LSE {_id(dtype)}: vs float64 {exact_gap:.2e}, vs twin {twin_gap:.2e}; out vs twin {out_gap:.2e}")
    assert exact_gap <= 2e-2 and twin_gap <= 5e-3 and out_gap <= TWIN_REL_L2[kernel]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("seq", [4608, 16896])
def test_v_offset_against_float64_and_twin(seq: int, kernel: str) -> None:
    """V with a 5-sigma channel offset ("v_offset"): O's mean part is a positive sum over all keys. Summed over all
    tiles in the FP8 wgmma's accumulator (~14 significant bits) it came out 8.4e-2 (4608) and 0.26 (16896) from
    the twin on the H200; promoted to f32 per tile, 1.8e-3. The twin is 9e-4 to 1e-3 from float64 here."""
    q, k, v = (t.cuda().bfloat16() for t in study_inputs("v_offset", 1, 2, seq, 128, seed=seq))
    skip_unless_runs(q, k, v, kernel=kernel)
    out = attention(q, k, v, kernel=kernel).double()
    twin_gap = error_metrics(out, kernel_twin(q, k, v, 128**-0.5, kernel=kernel).double())["rel_l2"]
    exact_gap = error_metrics(out, attention_float64(q, k, v))["rel_l2"]
    print(f"{kernel} v_offset N{seq}: vs twin rel_l2 {twin_gap:.2e}, vs float64 {exact_gap:.2e}")
    assert twin_gap <= TWIN_REL_L2[kernel] and exact_gap <= 1e-2


def prepass_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str) -> Callable[..., torch.Tensor]:
    """Run the quantising prepass of P.V scheme `pv` on contiguous head-major bf16 q, k, v `[B, H, N, 128]`;
    returns `part(name, dtype, shape)`, a view of one of its outputs (`quantized.workspace_layout`'s names)."""
    batch, heads, seq_q, _ = q.shape
    seq_k, device = k.shape[2], q.device.index
    geometry = Geometry(batch * heads, seq_q, seq_k, seq_q, seq_k, 128, q.dtype, heads, 128**-0.5 * LOG2E)
    function = nvrtc.function(quantize_variant(128, "bfloat16", pv), device)
    workspace, _ = quantize((q.data_ptr(), k.data_ptr(), v.data_ptr()), geometry, device, function, pv)
    layout = workspace_layout(batch * heads, seq_q, seq_k, 128, pv)

    def part(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        offset, size = layout[name]
        return workspace[offset : offset + size].view(dtype).view(shape)

    return part


def transposed_codes(codes: torch.Tensor, k_pad: int) -> torch.Tensor:
    """Per-key 8-bit codes `[B, H, Nk, 128]` laid out as the prepass writes V^T, `[B, H, 128, k_pad]`: keys
    permuted in 32-key chunks as the kernel's P registers hold them (q8_scores.cuh), 0 past Nk."""
    batch, heads, seq_k, _ = codes.shape
    logical = torch.arange(k_pad, device=codes.device)
    r = logical % 32
    physical = logical - r + (r & 16) + 8 * ((r >> 1) & 1) + 2 * ((r >> 2) & 3) + (r & 1)
    padded = torch.zeros(batch, heads, k_pad, 128, dtype=codes.dtype, device=codes.device)
    padded[:, :, :seq_k] = codes
    return padded[:, :, physical].transpose(2, 3)


def test_prepass_matches_torch_quantisers() -> None:
    batch, heads, seq_q, seq_k = 2, 3, 200, 300
    q, k, v = qkv((batch, heads, seq_q, seq_k), torch.bfloat16, seed=9)
    k = k + 3.0  # an offset for smoothing to remove
    skip_unless_runs(q, k, v)
    scale_log2 = 128**-0.5 * LOG2E
    part = prepass_parts(q, k, v, "0")
    q_codes, q_scales = quantize_int8_blocks(q, 64, scale_log2)
    k_codes, k_scales = quantize_int8_blocks(smooth_k(k)[0], 128)
    v_codes, v_scales = quantize_fp8_channels(v)
    got_q = part("q8", torch.int8, (batch, heads, seq_q, 128))
    got_k = part("k8", torch.int8, (batch, heads, seq_k, 128))
    assert torch.equal(got_q, q_codes), f"{(got_q != q_codes).sum().item()} q codes differ"
    # k is smoothed by a mean the kernel sums in another order: codes may differ at rounding ties
    assert (got_k.int() - k_codes.int()).abs().max().item() <= 1 and (got_k != k_codes).float().mean().item() <= 1e-3
    torch.testing.assert_close(part("q_scale", torch.float32, q_scales.shape), q_scales, rtol=1e-6, atol=0)
    torch.testing.assert_close(part("k_scale", torch.float32, k_scales.shape), k_scales, rtol=1e-5, atol=0)
    torch.testing.assert_close(part("v_scale", torch.float32, (batch, heads, 1, 128)), v_scales, rtol=1e-6, atol=0)
    k_pad = 384
    vt = part("vt8", torch.uint8, (batch, heads, 128, k_pad))
    want = transposed_codes(v_codes.view(torch.uint8), k_pad)
    # exact since the twin divides 448 / absmax once (torch's float / tensor rounds twice: one-step flips on
    # ~0.1% of codes, once blamed on the E4M3 conversion); on the H200 since, 0 of 32.8M q codes and 0 of
    # 32.9M V^T codes differ (benchmarks/results/h200_prepass_codes_vs_twin.txt)
    assert torch.equal(vt, want), f"{(vt != want).sum().item()} V^T codes differ, are out of order or not 0 past Nk"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_key_lens(dtype: torch.dtype, kernel: str) -> None:
    """Keys past a batch's count hold NaN in k and 1e4 in v here: they must enter neither K's mean nor any scale,
    statistic or code (a 1e4 in V's range would coarsen every V code of the channel)."""
    counts = [1000, 0, 129]
    q, k, v = qkv((3, 2, 77, 1000), dtype, seed=13)
    for b, count in enumerate(counts):
        k[b, :, count:] = float("nan")
        v[b, :, count:] = 1e4
    skip_unless_runs(q, k, v, kernel=kernel)
    key_lens = torch.tensor(counts, dtype=torch.int32, device=q.device)
    lse = torch.full((3, 77, 2), float("nan"), device=q.device)
    out = poisoned_call(q, k, v, kernel, key_lens=key_lens, lse=lse).double()
    assert torch.equal(out[1], torch.zeros_like(out[1])), "a batch without keys must get rows of 0"
    assert torch.isneginf(lse[1]).all(), "a batch without keys must get LSE -inf"
    twin = kernel_twin(q, k, v, 128**-0.5, key_lens=key_lens, kernel=kernel).double()
    for b in (0, 2):
        exact = attention_float64(q[b : b + 1], k[b : b + 1, :, : counts[b]], v[b : b + 1, :, : counts[b]])
        metrics = error_metrics(out[b : b + 1], exact)
        assert metrics["cos"] >= FLOAT64_COS and metrics["rel_l1"] <= FLOAT64_REL_L1, (b, metrics)
        assert error_metrics(out[b : b + 1], twin[b : b + 1])["rel_l2"] <= TWIN_REL_L2[kernel]
        assert torch.isfinite(lse[b]).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_windows_match_separate_calls(kernel: str) -> None:
    q, k, v = qkv((1, 3, 700, 900), torch.bfloat16, seed=17)
    skip_unless_runs(q, k, v, kernel=kernel)
    windows = [Window(0, 300, 0, 450), Window(300, 700, 200, 900)]
    out = windowed_attention(q, k, v, windows, out_dtype=q.dtype, kernel=kernel)
    for w in windows:
        rows, keys = slice(w.q_start, w.q_stop), slice(w.k_start, w.k_stop)
        alone = attention(
            q[:, :, rows].contiguous(), k[:, :, keys].contiguous(), v[:, :, keys].contiguous(), kernel=kernel
        )
        assert torch.equal(out[:, rows], alone), f"window {w} differs from its own call"


@pytest.mark.parametrize("kernel", KERNELS)
def test_deterministic_and_layout_independent(kernel: str) -> None:
    q, k, v = qkv((2, 4, 1000, 1000), torch.bfloat16, seed=21)
    skip_unless_runs(q, k, v, kernel=kernel)
    first = attention(q, k, v, kernel=kernel)
    assert torch.equal(first, attention(q, k, v, kernel=kernel)), "two calls on the same inputs differ"
    token_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert torch.equal(first, attention(*token_major, kernel=kernel))


@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_pictor_attn_fp8_eager_and_compiled(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """An fp32 model, so that eager and inductor differ only in rounding q, k, v to bf16 before quantising."""
    config = {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32, 32, 32, 32)}
    model = build_transformer(config, device="cuda")
    inputs = transformer_inputs(model, batch=2, latent_hw=(12, 10), text_len=33)
    if cannot_run(kernel, *(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))):
        pytest.skip(f"the {kernel} kernel cannot run on this device")
    model.set_attn_processor(PictorAttn(precision="bf16"))
    bf16 = model(**inputs)[0].double()
    model.set_attn_processor(PictorAttn(precision="fp8", kernel=kernel))
    calls = count_launches(monkeypatch, "8bit")
    eager = model(**inputs)[0]
    assert calls[0] == model.config.num_layers + model.config.num_single_layers
    rel = ((eager.double() - bf16).norm() / bf16.norm()).item()
    print(f"tiny FLUX.2, {kernel} vs bf16 path: rel_l2 {rel:.2e}")
    assert torch.isfinite(eager).all() and rel <= 0.05
    compiled = torch.compile(model, fullgraph=True)(**inputs)[0]
    assert calls[0] == 2 * (model.config.num_layers + model.config.num_single_layers), "compiled: not the fp8 kernel"
    assert ((compiled.double() - eager.double()).norm() / eager.double().norm()).item() <= 1e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_inputs_give_nan_outputs(kernel: str) -> None:
    """A NaN in q makes its row NaN, one in v its channel (every row), as in torch; never a finite result over
    codes of 0 (the prepass's scales carry the NaN: max.NaN, not fmaxf). Other heads stay finite."""
    q, k, v = qkv((1, 3, 300, 400), torch.bfloat16, seed=29)
    q[0, 0, 17, 5] = float("nan")
    v[0, 1, 123, 9] = float("nan")
    skip_unless_runs(q, k, v, kernel=kernel)
    out = poisoned_call(q, k, v, kernel).float()
    assert torch.isnan(out[0, 17, :128]).all(), "a NaN in q must make its row NaN"
    assert torch.isnan(out[0, :, 128 + 9]).all(), "a NaN in v must make its channel NaN"
    assert torch.isfinite(out[0, :, 256:]).all(), "a head without NaN inputs must stay finite"
