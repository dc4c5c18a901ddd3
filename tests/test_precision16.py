"""The 16-bit fast path on CPU: `attention` with bf16/fp16 inputs, its validation, and
`PictorAttn(precision=...)`.

* CPU attention on 16-bit inputs is the float32 online-softmax reference on the
  upcast inputs, rounded once to the input dtype: bitwise that, and within one
  16-bit ulp of float64 SDPA on the same (16-bit) inputs.
* Wrong combinations (out dtype, kernel family, precision) raise ValueError
  naming every value involved.
* Whole tiny FLUX.2 models: precision "bf16"/"fp16" packs q/k/v in that dtype
  and stays within 2 x the stock processor's own low-precision error + 1e-4
  (the contract of test_processor_parity); "auto" follows the model dtype.
  Measured (torch 2.13 CPU) rel L2 vs the float32 model: bf16 3.31e-2 for both
  stock and PictorAttn, fp16 8.87e-4 stock, 8.92e-4 PictorAttn.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import pictor_diffusers.integration.processor as processor_module
from pictor_diffusers import PictorAttn, attention
from pictor_diffusers.ops.prologue import Segment, pack_head_major, pack_head_major_torch
from pictor_diffusers.ops.reference import online_softmax_attention
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs

Shape = tuple[int, int, int, int]
HALF = [torch.bfloat16, torch.float16]
# N = 1, 77, 257, 1000: not multiples of the 128-row / 64-key tiles; D = 200 has no 16-bit kernel.
SHAPES: list[Shape] = [(1, 2, 1, 128), (2, 3, 77, 128), (1, 2, 257, 64), (2, 1, 1000, 128), (1, 2, 33, 200)]
SHAPE_IDS = ["B{}H{}N{}D{}".format(*shape) for shape in SHAPES]
LOW_PRECISION_FACTOR, LOW_PRECISION_EPS = 2.0, 1e-4


def qkv(shape: Shape, dtype: torch.dtype, seed: int = 0, mult: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * mult).to(dtype) for _ in range(3)]


def names_all(*values: object) -> str:
    """A `match=` regex requiring every value's str() somewhere in the message, in any order."""
    return "".join(f"(?=.*{re.escape(str(value))})" for value in values)


def float64_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, head_dim = q.shape
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cpu_attention_16bit(shape: Shape, dtype: torch.dtype) -> None:
    q, k, v = qkv(shape, dtype, seed=sum(shape))
    out = attention(q, k, v)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2], shape[1] * shape[3]) and out.is_contiguous()
    expected = online_softmax_attention(q.float(), k.float(), v.float(), shape[-1] ** -0.5).to(dtype)
    assert torch.equal(out, expected), "not the float32 reference on the upcast inputs, rounded once"
    truth = float64_attention(q, k, v)
    one_ulp = truth.abs() * torch.finfo(dtype).eps + 1e-6
    beyond = (out.double() - truth).abs() > one_ulp
    assert not beyond.any(), f"{int(beyond.sum())} elements more than one {dtype} ulp from float64"
    for kernel in ("auto", "wgmma", "mma16"):
        assert torch.equal(attention(q, k, v, out_dtype=dtype, kernel=kernel), out), f"kernel={kernel!r} differs"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_cpu_attention_16bit_large_logits(dtype: torch.dtype) -> None:
    """q, k, v x8 (logits ~300): f32 logit rounding alone costs up to ~1e-3 here, so the bound is one
    16-bit ulp plus 2 x float32 SDPA's own max-abs error on the same inputs."""
    q, k, v = qkv((2, 3, 77, 128), dtype, seed=2, mult=8.0)
    out = attention(q, k, v)
    assert torch.isfinite(out).all()
    truth = float64_attention(q, k, v)
    f32_error = (attention_sdpa_f32(q, k, v).double() - truth).abs().max().item()
    beyond = (out.double() - truth).abs() > truth.abs() * torch.finfo(dtype).eps + 2.0 * f32_error
    assert not beyond.any(), f"{int(beyond.sum())} elements beyond one ulp + 2 x f32 SDPA's error {f32_error:.2e}"


def attention_sdpa_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, head_dim = q.shape
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def test_float32_default_out_dtype_is_float32() -> None:
    q, k, v = qkv((1, 2, 7, 32), torch.float32)
    assert attention(q, k, v).dtype == torch.float32
    assert torch.equal(attention(q, k, v, out_dtype=None), attention(q, k, v, out_dtype=torch.float32))


# Validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
    ids=["bf16-to-fp16", "bf16-to-fp32", "fp16-to-bf16"],
)
def test_16bit_out_dtype_must_be_the_input_dtype(dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=names_all(dtype, out_dtype)):
        attention(*qkv((1, 2, 7, 64), dtype), out_dtype=out_dtype)


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [
        ("tf32x3", torch.bfloat16),
        ("f32", torch.float16),
        ("wgmma", torch.float32),
        ("mma16", torch.float32),
    ],
)
def test_kernel_from_the_other_family(kernel: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=names_all(repr(kernel), dtype)):
        attention(*qkv((1, 2, 7, 64), dtype), kernel=kernel)


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kernel", ["WGMMA", "mma", "tf32"])
def test_unknown_kernel_with_16bit_inputs(kernel: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"kernel must be one of .*, got {re.escape(repr(kernel))}$"):
        attention(*qkv((1, 2, 7, 64), dtype), kernel=kernel)


def test_raw_custom_op_checks_the_16bit_out_dtype() -> None:
    q, k, v = qkv((1, 2, 9, 64), torch.bfloat16)
    with pytest.raises(ValueError, match=names_all(torch.bfloat16, torch.float32)):
        torch.ops.pictor.attention(q, k, v, 0.125, "auto", "float32")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 77, 128), (1, 1, 33, 64)], ids=["B2H3N77D128", "B1H1N33D64"])
def test_custom_op_opcheck_16bit(shape: Shape, dtype: torch.dtype) -> None:
    args = (*qkv(shape, dtype, seed=6), shape[-1] ** -0.5, "auto", str(dtype).removeprefix("torch."))
    results = torch.library.opcheck(torch.ops.pictor.attention.default, args)
    assert all(value == "SUCCESS" for value in results.values()), results


VALID = [("auto", "fp32"), ("tf32x3", "fp32"), ("f32", "fp32"), ("auto", "auto")] + [
    (kernel, precision) for precision in ("bf16", "fp16") for kernel in ("auto", "wgmma", "mma16")
]
INVALID = [("wgmma", "fp32"), ("mma16", "fp32"), ("tf32x3", "bf16"), ("f32", "fp16"), ("wgmma", "auto")]


@pytest.mark.parametrize(("kernel", "precision"), VALID)
def test_precision_kernel_combinations(kernel: str, precision: str) -> None:
    processor = PictorAttn(kernel=kernel, precision=precision)
    assert processor.kernel == kernel and processor.precision == precision


def test_default_precision_is_fp32() -> None:
    assert PictorAttn().precision == "fp32"


@pytest.mark.parametrize(("kernel", "precision"), INVALID)
def test_precision_kernel_mismatch(kernel: str, precision: str) -> None:
    with pytest.raises(ValueError, match=names_all(repr(kernel), repr(precision))):
        PictorAttn(kernel=kernel, precision=precision)


@pytest.mark.parametrize("precision", ["fp64", "bfloat16", "FP32", ""])
def test_unknown_precision(precision: str) -> None:
    with pytest.raises(ValueError, match=rf"precision must be one of .*, got {re.escape(repr(precision))}$"):
        PictorAttn(precision=precision)


# The prologue's 16-bit output -----------------------------------------------------------------


def _segments(model_dtype: torch.dtype, heads: int = 3, head_dim: int = 64) -> tuple[list[Segment], tuple]:
    generator = torch.Generator().manual_seed(4)
    norms = []
    for _ in range(4):
        norm = torch.nn.RMSNorm(head_dim, eps=1e-6)
        norm.weight.data = torch.rand(head_dim, generator=generator) + 0.5
        norms.append(norm)
    tokens = (5, 19)
    segments = [
        Segment(*(torch.randn(2, n, heads * head_dim, generator=generator).to(model_dtype) for _ in range(3)), qn, kn)
        for n, qn, kn in zip(tokens, norms[::2], norms[1::2], strict=True)
    ]
    angles = torch.rand(sum(tokens), head_dim // 2, generator=generator) * 6.3
    rope = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    return segments, rope


@pytest.mark.parametrize("out_dtype", HALF, ids=str)
@pytest.mark.parametrize("model_dtype", [torch.float32, *HALF], ids=str)
def test_pack_head_major_16bit_is_the_f32_result_rounded_once(model_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    segments, rope = _segments(model_dtype)
    ours = pack_head_major(segments, 64, rope, dtype=out_dtype)
    projections = [t for segment in segments for t in segment[:3]]
    weights = [segment.norm_q.weight.float() for segment in segments]
    weights = [weights[0], segments[0].norm_k.weight.float(), weights[1], segments[1].norm_k.weight.float()]
    reference = pack_head_major_torch(projections, weights, list(rope), [1e-6] * 4)
    for name, got, ref in zip("qkv", ours, reference, strict=True):
        assert got.dtype == out_dtype and got.is_contiguous() and got.shape == (2, 3, 24, 64)
        assert torch.equal(got, ref.to(out_dtype)), f"{name}: not the f32 prologue rounded once to {out_dtype}"


@pytest.mark.parametrize("norm", ["none", "layer_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
def test_pack_head_major_without_rms_norms_is_contiguous(dtype: torch.dtype, norm: str) -> None:
    """The torch path for SD3 / CogVideoX norms copies v too when it is already in `dtype`."""
    segments, rope = _segments(dtype)
    make = (lambda: None) if norm == "none" else (lambda: torch.nn.LayerNorm(64, eps=1e-6).to(dtype))
    segments = [segment._replace(norm_q=make(), norm_k=make()) for segment in segments]
    for got in pack_head_major(segments, 64, rope, dtype=dtype, kv_gap=(5, 3)):
        assert got.dtype == dtype and got.is_contiguous() and got.shape[:2] == (2, 3)
    value = pack_head_major(segments, 64, None, dtype=dtype)[2]
    expected = torch.cat([segment.value for segment in segments], dim=1).unflatten(-1, (3, 64)).transpose(1, 2)
    assert torch.equal(value, expected)


def test_pack_head_major_refuses_other_dtypes() -> None:
    segments, rope = _segments(torch.float32)
    with pytest.raises(ValueError, match=re.escape(str(torch.float64))):
        pack_head_major(segments, 64, rope, dtype=torch.float64)


# Whole tiny models ----------------------------------------------------------------------------


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@contextmanager
def attention_dtypes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[torch.dtype]]:
    """Record the dtype of every q that PictorAttn hands to `attention`."""
    seen: list[torch.dtype] = []
    original = processor_module.attention

    def recording(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append(query.dtype)
        return original(query, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(processor_module, "attention", recording)
        yield seen


def forward(model: torch.nn.Module, inputs: dict, processor: PictorAttn | None) -> torch.Tensor:
    with torch.no_grad():
        if processor is None:
            set_stock_processors(model)
        else:
            model.set_attn_processor(processor)
        out = model(**inputs)[0]
    assert torch.isfinite(out).all(), "NaN/Inf in the model output"
    return out


def model_and_inputs(dtype: torch.dtype, fused: bool) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """The tiny model in `dtype`, its inputs and the float32 stock output it was cast from."""
    model32 = build_transformer(TINY_CONFIG)
    if fused:
        model32.fuse_qkv_projections()
    truth = forward(model32, transformer_inputs(model32, 2, (3, 5), 7), None)
    model = copy.deepcopy(model32).to(dtype)
    return model, transformer_inputs(model, 2, (3, 5), 7), truth


PRECISION_OF = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_16bit_precision_within_stock_error(dtype: torch.dtype, fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs, truth = model_and_inputs(dtype, fused)
    stock = forward(model, inputs, None)
    with attention_dtypes(monkeypatch) as seen:
        ours = forward(model, inputs, PictorAttn(precision=PRECISION_OF[dtype]))
    calls = model.config.num_layers + model.config.num_single_layers
    assert seen == [dtype] * calls, f"q handed to attention in {seen}, expected {dtype} x {calls}"
    assert ours.dtype == dtype and ours.shape == stock.shape
    stock_error, ours_error = rel_l2(stock, truth), rel_l2(ours, truth)
    bound = LOW_PRECISION_FACTOR * stock_error + LOW_PRECISION_EPS
    print(f"{dtype} fused={fused}: rel L2 vs float32: stock {stock_error:.2e}, precision16 {ours_error:.2e}")
    assert ours_error <= bound, f"{dtype}: rel L2 {ours_error:.3e} vs float32 > {bound:.3e} (stock {stock_error:.3e})"
    auto = forward(model, inputs, PictorAttn(precision="auto"))
    assert torch.equal(auto, ours), 'precision="auto" on a 16-bit model is not the 16-bit path'


def test_auto_precision_on_a_float32_model_is_the_parity_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_transformer(TINY_CONFIG)
    inputs = transformer_inputs(model, 1, (5, 7), 11)
    with attention_dtypes(monkeypatch) as seen:
        auto = forward(model, inputs, PictorAttn(precision="auto"))
    assert set(seen) == {torch.float32}
    assert torch.equal(auto, forward(model, inputs, PictorAttn(precision="fp32")))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_precision_on_a_float32_model(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only q/k/v and the attention output are 16-bit: the error stays under a tenth of a whole 16-bit model's.

    Measured (torch 2.13 CPU): bf16 5.4e-5 against 3.3e-2, fp16 6.8e-6 against 8.9e-4.
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model, inputs16, truth = model_and_inputs(dtype, fused=False)
    whole_model_error = rel_l2(forward(model, inputs16, None), truth)
    model32 = build_transformer(TINY_CONFIG)
    inputs = transformer_inputs(model32, 2, (3, 5), 7)
    with attention_dtypes(monkeypatch) as seen:
        ours = forward(model32, inputs, PictorAttn(precision=precision))
    assert set(seen) == {dtype} and ours.dtype == torch.float32
    error = rel_l2(ours, truth)
    print(f"{precision} attention in a float32 model: rel L2 {error:.2e}, whole {dtype} model {whole_model_error:.2e}")
    assert error <= 0.1 * whole_model_error, (
        f"rel L2 {error:.3e} > 0.1 x a whole {dtype} model's {whole_model_error:.3e}"
    )
