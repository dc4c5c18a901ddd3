"""The f32 CUDA kernel against float64 SDPA, plus stream, graph and determinism checks.

Every launch writes into an output poisoned with NaN, so an unwritten element
fails the test; inputs are fresh N(0,1) draws for every case.
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import attention
from pictor_diffusers.testing.references import attention_float64, random_qkv

pytestmark = pytest.mark.gpu

MAX_ABS = 1e-5

# (B, H, N, D): FLUX.2 heads 24/32/48, N from 512²/1024² images, odd N, head_dim 128 and 64.
CASES = [
    (1, 24, 1536, 128),
    (2, 24, 1536, 128),
    (1, 32, 1536, 128),
    (1, 48, 1536, 64),
    (1, 24, 4608, 128),
    (1, 48, 4608, 128),
    (2, 32, 4608, 64),
    (1, 24, 1, 128),
    (2, 24, 77, 128),
    (1, 32, 1000, 64),
    (2, 48, 4097, 128),
    (1, 24, 4097, 64),
]
# Other kernel variants: head_dim not a multiple of 32, the lean d256 and wide d384 builds.
VARIANT_CASES = [(1, 4, 333, 200), (2, 3, 77, 256), (1, 2, 129, 384), (1, 3, 50, 17)]


# head_dims the tensor-core kernel compiles for, at odd N.
TF32X3_CASES = [(1, 3, 77, 32), (2, 5, 300, 96), (1, 4, 129, 64)]


def _run_kernel(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One launch of `kernel` ("f32", "tf32x3" or "fp16x3") into a NaN-poisoned float32 output."""
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import plan_attention

    batch, heads, seq, head_dim = query.shape
    out = torch.full((batch, seq, heads * head_dim), float("nan"), device="cuda")
    result = run(plan_attention(query, key, value, head_dim**-0.5, kernel, torch.float32, out=out))
    assert result.data_ptr() == out.data_ptr(), "the kernel did not write the given output"
    return result


def _shape_id(shape: tuple[int, int, int, int]) -> str:
    return "B{}-H{}-N{}-D{}".format(*shape)


KERNEL_CASES = (
    [("f32", s) for s in CASES + VARIANT_CASES]
    + [("tf32x3", s) for s in CASES + TF32X3_CASES]
    + [("fp16x3", s) for s in CASES if s[3] == 128]
)


@pytest.mark.parametrize(("kernel", "shape"), KERNEL_CASES, ids=lambda x: x if isinstance(x, str) else _shape_id(x))
def test_kernel_matches_float64(kernel: str, shape: tuple[int, int, int, int]) -> None:
    query, key, value = random_qkv(*shape, seed=sum(shape))
    out = _run_kernel(kernel, query, key, value)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "kernel left poisoned (unwritten) or NaN elements"
    max_abs = (out.double() - attention_float64(query, key, value)).abs().max().item()
    print(f"{kernel} shape={shape} max_abs={max_abs:.3e}")
    assert max_abs <= MAX_ABS


def _sdpa_fp32_error(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ref: torch.Tensor) -> float:
    """max-abs error of torch's fp32 SDPA (math backend) on the same inputs: f32's own error here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    batch, heads, seq, head_dim = out.shape
    return (out.transpose(1, 2).reshape(batch, seq, heads * head_dim).double() - ref).abs().max().item()


@pytest.mark.parametrize(
    ("kernel", "shape"),
    [(k, s) for k in ("f32", "tf32x3") for s in ((1, 24, 4608, 128), (1, 8, 1000, 64))]
    + [("fp16x3", (1, 24, 4608, 128)), ("fp16x3", (1, 8, 1000, 128))],
    ids=lambda x: x if isinstance(x, str) else _shape_id(x),
)
def test_large_logits(kernel: str, shape: tuple[int, int, int, int]) -> None:
    """q and k x8 (logits up to ~250): finite, and within 2x of fp32 SDPA's own error.

    An absolute 1e-5 is out of reach for any f32 softmax here: a logit of 250
    carries an f32 rounding of ~1.5e-5, which the exponential passes on.
    """
    query, key, value = random_qkv(*shape, seed=7)
    query, key = query * 8.0, key * 8.0
    out = _run_kernel(kernel, query, key, value)
    ref = attention_float64(query, key, value)
    assert torch.isfinite(out).all()
    max_abs = (out.double() - ref).abs().max().item()
    sdpa_err = _sdpa_fp32_error(query, key, value, ref)
    print(f"{kernel} shape={shape} x8 max_abs={max_abs:.3e} sdpa_fp32_math={sdpa_err:.3e}")
    assert max_abs <= 2.0 * sdpa_err + 1e-6


@pytest.mark.parametrize("kernel", ["tf32x3", "fp16x3"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tensor_core_kernels_round_once_into_16bit(kernel: str, out_dtype: torch.dtype) -> None:
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import plan_attention

    query, key, value = random_qkv(2, 6, 1000, 128, seed=13)
    out = torch.full((2, 1000, 768), float("nan"), device="cuda", dtype=out_dtype)
    run(plan_attention(query, key, value, 128**-0.5, kernel, out_dtype, out=out))
    expected = attention_float64(query, key, value).to(out_dtype)
    assert not out.isnan().any()
    one_ulp = expected.float().abs() * torch.finfo(out_dtype).eps + 1e-7
    beyond_one_ulp = (out.float() - expected.float()).abs() > one_ulp
    assert beyond_one_ulp.float().mean().item() < 1e-3


def test_auto_picks_tensor_cores_and_matches_reference_kernel() -> None:
    query, key, value = random_qkv(1, 24, 1536, 128, seed=17)
    fast = attention(query, key, value)
    reference = attention(query, key, value, kernel="f32")
    assert (fast - reference).abs().max().item() <= MAX_ABS


def test_public_api_matches_kernel_and_cpu_twin() -> None:
    query, key, value = random_qkv(2, 4, 333, 64, seed=3)
    out = attention(query, key, value)
    assert out.shape == (2, 333, 256) and out.device.type == "cuda"
    cpu = attention(query.cpu(), key.cpu(), value.cpu())
    assert (out.cpu() - cpu).abs().max().item() <= MAX_ABS


@pytest.mark.parametrize("kernel", ["tf32x3", "fp16x3"])
def test_bitwise_deterministic(kernel: str) -> None:
    query, key, value = random_qkv(2, 24, 1536, 128, seed=11)
    first = _run_kernel(kernel, query, key, value)
    second = _run_kernel(kernel, query, key, value)
    assert torch.equal(first, second)


def test_non_default_stream_with_concurrent_work() -> None:
    side = torch.cuda.Stream()
    busy = torch.randn(8192, 8192, device="cuda")
    query, key, value = random_qkv(1, 24, 1536, 128, seed=5)
    ref = attention_float64(query, key, value)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q2, k2, v2 = (t * 1.0 for t in (query, key, value))
        out = attention(q2, k2, v2)
        checksum = out.sum()
    for _ in range(4):
        busy = busy @ busy / 8192.0
    torch.cuda.current_stream().wait_stream(side)
    assert (out.double() - ref).abs().max().item() <= MAX_ABS
    assert torch.isfinite(checksum)


def test_cuda_graph_capture_and_replay() -> None:
    query, key, value = random_qkv(1, 24, 1000, 128, seed=9)
    attention(query, key, value)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention(query, key, value)
    for seed in (21, 22):
        fresh = random_qkv(1, 24, 1000, 128, seed=seed)
        for static, new in zip((query, key, value), fresh, strict=True):
            static.copy_(new)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert (static_out.double() - attention_float64(*fresh)).abs().max().item() <= MAX_ABS


def test_second_device_index_is_respected() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    query, key, value = random_qkv(1, 4, 100, 64, seed=1, device="cuda:1")
    out = attention(query, key, value)
    assert out.device == query.device
    assert (out.double() - attention_float64(query, key, value)).abs().max().item() <= MAX_ABS
