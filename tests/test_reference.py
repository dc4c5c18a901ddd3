"""CPU attention (`reference.online_softmax_attention`, `attention`) against float64 SDPA.

The truth is `torch.nn.functional.scaled_dot_product_attention` on the same
inputs upcast to float64 (its own error, ~1e-16, is negligible here). Two
contracts, both on max-abs error, inputs N(0,1):

* absolute: <= `MAX_ABS_TOL[dtype]` for the default scale D**-0.5. Measured
  worst over `SHAPES` (torch 2.13 CPU): 1.5e-6 (f32 inputs), 1.6e-6 (f64
  inputs, rounded to f32 first), 8e-7 (bf16), 1.3e-6 (f16); the 1e-5 bound is
  the kernel's documented accuracy and leaves ~7x margin.
* relative to f32's own error: <= 2 x (error of float32 SDPA on the same
  inputs) + 1e-6. This is the contract for large logits (inputs x8: logits up
  to ~±300, where a softmax without the running max overflows exp), and for
  custom scales, where f32 rounding of the logits alone costs up to ~2e-3
  (x8, D=384: 1.9e-3 for both). Measured ratio to f32 SDPA: 0.999..1.002 at
  large logits, and the N(0,1) errors sit below 1e-6 + 0.53 x f32 SDPA's.

`tile_keys` 1, 32, 256 and 4096 agree to 5.1e-7 max-abs (bound 2e-6).

Shapes cover N = 1, 7, 77, 256, 257, 1000 (not multiples of the kernel's
8-row/32-key tiles nor of the CPU's 256-key tile) and D = 1..384.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pictor_diffusers import attention
from pictor_diffusers.ops.reference import CPU_TILE_KEYS, online_softmax_attention
from pictor_diffusers.testing.references import attention_float64, lse_float64

Shape = tuple[int, int, int, int]

SHAPES: list[Shape] = [
    (1, 1, 1, 32),
    (2, 3, 1, 64),
    (1, 2, 7, 64),
    (2, 1, 7, 200),
    (2, 4, 77, 128),
    (1, 3, 77, 384),
    (1, 2, 256, 128),
    (2, 1, 256, 32),
    (1, 3, 257, 200),
    (2, 2, 257, 64),
    (1, 4, 1000, 128),
    (2, 1, 1000, 384),
    (2, 2, 33, 1),
]
SHAPE_PARAMS = [pytest.param(shape, id="B{}H{}N{}D{}".format(*shape)) for shape in SHAPES]

# Liger-Kernel style table: input dtype -> (max-abs tolerance vs float64, worst measured).
# The contract is the tolerance; errors beyond REGRESSION_FACTOR x the worst measured fail too,
# as a regression alarm well inside the contract.
REGRESSION_FACTOR = 2.0
MAX_ABS_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1.5e-6),
    torch.float64: (1e-5, 1.6e-6),
    torch.bfloat16: (1e-5, 8.2e-7),
    torch.float16: (1e-5, 1.3e-6),
}
F32_ERROR_FACTOR = 2.0
F32_ERROR_FLOOR = 1e-6


def randn_qkv(shape: Shape, dtype: torch.dtype = torch.float32, mult: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator, dtype=torch.float64) * mult).to(dtype) for _ in range(3)]


def sdpa_token_major(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """SDPA in the dtype of its inputs, transposed to token-major `[B, N, H*D]`."""
    batch, heads, seq, head_dim = q.shape
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def errors(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[float, float]:
    """(max-abs error of `out`, max-abs error of float32 SDPA), both against float64 SDPA."""
    truth = sdpa_token_major(q.double(), k.double(), v.double(), scale)
    f32 = sdpa_token_major(q.float(), k.float(), v.float(), scale)
    return (out.double() - truth).abs().max().item(), (f32.double() - truth).abs().max().item()


def check_output(out: torch.Tensor, shape: Shape) -> None:
    batch, heads, seq, head_dim = shape
    assert out.shape == (batch, seq, heads * head_dim)
    assert out.dtype == torch.float32 and out.device.type == "cpu"
    assert torch.isfinite(out).all(), "NaN/Inf in the output"


def check_contiguous(out: torch.Tensor) -> None:
    """Checked last, so that the numerical checks run before the known head_dim-1 layout failure."""
    assert out.is_contiguous(), f"output {tuple(out.shape)} is not contiguous: strides {out.stride()}"


def check_within_f32(err: float, f32_err: float) -> None:
    bound = F32_ERROR_FACTOR * f32_err + F32_ERROR_FLOOR
    assert err <= bound, f"max-abs {err:.3e} > {F32_ERROR_FACTOR} x f32 SDPA's {f32_err:.3e} + {F32_ERROR_FLOOR}"


@pytest.mark.parametrize("dtype", list(MAX_ABS_TOL), ids=str)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_online_softmax_matches_float64(shape: Shape, dtype: torch.dtype) -> None:
    q, k, v = randn_qkv(shape, dtype)
    scale = shape[-1] ** -0.5
    out = online_softmax_attention(q, k, v, scale)
    check_output(out, shape)
    err, f32_err = errors(out, q, k, v, scale)
    tol, measured = MAX_ABS_TOL[dtype]
    assert err <= tol, f"max-abs {err:.3e} > {tol:.0e} for {dtype} inputs"
    alarm = REGRESSION_FACTOR * measured
    assert err <= alarm, f"max-abs {err:.3e} > {REGRESSION_FACTOR} x the worst measured {measured:.1e} ({dtype})"
    check_within_f32(err, f32_err)
    check_contiguous(out)


@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_attention_matches_float64(shape: Shape) -> None:
    q, k, v = randn_qkv(shape, seed=1)
    originals = [t.clone() for t in (q, k, v)]
    out = attention(q, k, v)
    check_output(out, shape)
    err, f32_err = errors(out, q, k, v, shape[-1] ** -0.5)
    assert err <= MAX_ABS_TOL[torch.float32][0], f"max-abs {err:.3e}"
    check_within_f32(err, f32_err)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), originals, strict=True)), "inputs were modified"
    check_contiguous(out)


LARGE_SHAPES = [(1, 2, 7, 64), (2, 4, 77, 128), (1, 3, 257, 200), (2, 1, 1000, 384)]


@pytest.mark.parametrize("fn", ["attention", "online_softmax_attention"])
@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=["B{}H{}N{}D{}".format(*s) for s in LARGE_SHAPES])
def test_large_logits(shape: Shape, fn: str) -> None:
    q, k, v = randn_qkv(shape, mult=8.0, seed=2)
    scale = shape[-1] ** -0.5
    logits = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    assert logits.abs().max() > 89.0, "inputs too small to overflow a softmax without the running max"
    out = attention(q, k, v) if fn == "attention" else online_softmax_attention(q, k, v, scale)
    check_output(out, shape)
    check_within_f32(*errors(out, q, k, v, scale))


@pytest.mark.parametrize("scale", [0.01, 0.3, 1.0])
@pytest.mark.parametrize(
    "shape", [(2, 2, 7, 64), (1, 3, 257, 200), (2, 1, 77, 32)], ids=["N7D64", "N257D200", "N77D32"]
)
def test_custom_scale(shape: Shape, scale: float) -> None:
    q, k, v = randn_qkv(shape, seed=3)
    out = attention(q, k, v, scale=scale)
    check_output(out, shape)
    err, f32_err = errors(out, q, k, v, scale)
    check_within_f32(err, f32_err)
    default = errors(attention(q, k, v), q, k, v, scale)[0]
    assert default > 10 * max(err, F32_ERROR_FLOOR), "scale was ignored: the default scale matches as well"


@pytest.mark.parametrize("shape", [(2, 2, 7, 64), (1, 3, 257, 200)], ids=["N7D64", "N257D200"])
def test_default_scale_is_inverse_sqrt_head_dim(shape: Shape) -> None:
    q, k, v = randn_qkv(shape, seed=4)
    assert torch.equal(attention(q, k, v), attention(q, k, v, scale=shape[-1] ** -0.5))


TILE_SHAPES = [(2, 2, 7, 64), (1, 3, 257, 200), (1, 2, 1000, 32)]


@pytest.mark.parametrize("shape", TILE_SHAPES, ids=["N7D64", "N257D200", "N1000D32"])
def test_tile_keys_variants_agree(shape: Shape) -> None:
    q, k, v = randn_qkv(shape, seed=5)
    scale = shape[-1] ** -0.5
    outs = {tile: online_softmax_attention(q, k, v, scale, tile_keys=tile) for tile in (1, 32, CPU_TILE_KEYS, 4096)}
    for tile, out in outs.items():
        check_output(out, shape)
        err, f32_err = errors(out, q, k, v, scale)
        assert err <= MAX_ABS_TOL[torch.float32][0], f"tile_keys={tile}: max-abs {err:.3e}"
        check_within_f32(err, f32_err)
    for tile, out in outs.items():
        spread = (out - outs[CPU_TILE_KEYS]).abs().max().item()
        assert spread <= 2e-6, f"tile_keys={tile} differs from {CPU_TILE_KEYS} by {spread:.3e}"


OPCHECK_SHAPES = [
    pytest.param((2, 3, 77, 64), id="B2H3N77D64"),
    pytest.param((1, 1, 257, 200), id="B1H1N257D200"),
    pytest.param((2, 2, 33, 1), id="B2H2N33D1"),
]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
def test_custom_op_opcheck(shape: Shape, out_dtype: torch.dtype) -> None:
    """The registered op's schema, fake (meta) implementation and AOT tracing agree with the real one."""
    q, k, v = randn_qkv(shape, seed=6)
    args = (q, k, v, shape[-1] ** -0.5, "auto", str(out_dtype).removeprefix("torch."))
    results = torch.library.opcheck(torch.ops.pictor.attention.default, args)
    assert all(value == "SUCCESS" for value in results.values()), results


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 77, 64), (1, 2, 257, 200)], ids=["B2H3N77D64", "B1H2N257D200"])
def test_out_dtype_rounds_the_f32_result_once(shape: Shape, out_dtype: torch.dtype) -> None:
    q, k, v = randn_qkv(shape, seed=7)
    f32 = attention(q, k, v)
    for kernel in ("auto", "f32"):
        out = attention(q, k, v, out_dtype=out_dtype, kernel=kernel)
        assert out.dtype == out_dtype and out.shape == f32.shape
        assert torch.equal(out, f32.to(out_dtype)), f"kernel={kernel!r}: not the f32 result rounded to {out_dtype}"


UNEQUAL = [(1, 2, 7, 300, 64), (2, 3, 257, 77, 128), (1, 1, 1, 1000, 32), (2, 2, 1000, 1, 96)]


@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k", "head_dim"), UNEQUAL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unequal_lengths_and_lse_match_float64(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                                               dtype: torch.dtype) -> None:  # fmt: skip
    """Nq != Nk (neither a multiple of the 256-key tile) and the LSE output, against float64."""
    generator = torch.Generator().manual_seed(seq_q * 7 + seq_k)
    query = torch.randn(batch, heads, seq_q, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(batch, heads, seq_k, head_dim, generator=generator).to(dtype) for _ in range(2))
    out, lse = attention(query, key, value, out_dtype=torch.float32 if dtype == torch.float32 else None,
                         return_lse=True)  # fmt: skip
    assert out.shape == (batch, seq_q, heads * head_dim) and lse.shape == (batch, seq_q, heads)
    assert lse.dtype == torch.float32
    expected = attention_float64(query, key, value)
    assert (out.double() - expected).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert (lse.double() - lse_float64(query, key)).abs().max().item() <= 1e-5
