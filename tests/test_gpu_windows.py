"""Every attention kernel with unequal query/key lengths, the log-sum-exp output and row windows.

Against float64 on the same inputs (16-bit kernels: the same 16-bit-rounded
inputs). Outputs and LSE are poisoned with NaN before each launch: rows a
window leaves out must stay NaN, rows it covers must be written. Inputs are
fresh N(0,1) draws; lengths are not multiples of any kernel's tiles (the
192-row query blocks of wgmma at head_dim 64 included). head_dim 128 and 64,
where a kernel runs it.
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers.testing.references import attention_float64, lse_float64

pytestmark = pytest.mark.gpu

# kernel, input dtype, output max-abs bound against float64.
KERNELS = [
    ("f32", torch.float32, 1e-5),
    ("tf32x3", torch.float32, 1e-5),
    ("fp16x3", torch.float32, 1e-5),
    ("wgmma", torch.bfloat16, 2e-2),
    ("wgmma", torch.float16, 4e-3),
    ("mma16", torch.bfloat16, 2e-2),
]
LSE_MAX_ABS = 1e-5
# (B, H, Nq, Nk): Nq < Nk and Nq > Nk, one key, a klein-KV-like text+image over text+ref+image.
LENGTHS = [(1, 3, 200, 1000), (2, 2, 1000, 77), (1, 2, 129, 1), (1, 4, 1536, 2560)]
HEAD_DIMS = pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])


def _skip_unless_runs(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    from pictor_diffusers.cuda.plan import cannot_run

    out_dtype = torch.float32 if query.dtype == torch.float32 else query.dtype
    reason = cannot_run(kernel, query, key, value, out_dtype)
    if reason is not None:
        pytest.skip(reason)


def _inputs(batch: int, heads: int, seq_q: int, seq_k: int, dtype: torch.dtype, seed: int, head_dim: int = 128):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    query = torch.randn(batch, heads, seq_q, head_dim, device="cuda", generator=generator).to(dtype)
    key, value = (
        torch.randn(batch, heads, seq_k, head_dim, device="cuda", generator=generator).to(dtype) for _ in "kv"
    )
    return query, key, value


def _launch(kernel: str, query, key, value, window=None):
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import plan_attention

    batch, heads, seq_q, head_dim = query.shape
    out_dtype = torch.float32 if query.dtype == torch.float32 else query.dtype
    out = torch.full((batch, seq_q, heads * head_dim), float("nan"), device="cuda", dtype=out_dtype)
    lse = torch.full((batch, seq_q, heads), float("nan"), device="cuda")
    run(plan_attention(query, key, value, head_dim**-0.5, kernel, out_dtype, out=out, lse=lse, window=window))
    torch.cuda.synchronize()
    return out, lse


@HEAD_DIMS
@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k"), LENGTHS)
@pytest.mark.parametrize(("kernel", "dtype", "bound"), KERNELS, ids=lambda x: str(x).removeprefix("torch."))
def test_unequal_lengths_and_lse(kernel: str, dtype: torch.dtype, bound: float, batch: int, heads: int,
                                 seq_q: int, seq_k: int, head_dim: int) -> None:  # fmt: skip
    query, key, value = _inputs(batch, heads, seq_q, seq_k, dtype, seed=seq_q + seq_k, head_dim=head_dim)
    _skip_unless_runs(kernel, query, key, value)
    out, lse = _launch(kernel, query, key, value)
    out_error = (out.double() - attention_float64(query, key, value)).abs().max().item()
    lse_error = (lse.double() - lse_float64(query, key)).abs().max().item()
    label = f"{kernel} {dtype} D{head_dim} {batch}x{heads} Nq={seq_q} Nk={seq_k}"
    print(f"{label}: out {out_error:.2e}, lse {lse_error:.2e}")
    assert out_error <= bound
    assert lse_error <= LSE_MAX_ABS


@HEAD_DIMS
@pytest.mark.parametrize(("seq_k", "k_stop"), [(1000, 700), (2400, 2300)], ids=["short-keys", "long-keys"])
@pytest.mark.parametrize(("kernel", "dtype", "bound"), KERNELS, ids=lambda x: str(x).removeprefix("torch."))
def test_window_writes_only_its_rows(kernel: str, dtype: torch.dtype, bound: float, seq_k: int, k_stop: int,
                                     head_dim: int) -> None:  # fmt: skip
    """Query rows [3, 150) over keys [40, k_stop) of a 300 x seq_k problem (the klein-KV extract step's
    "reference queries see reference keys" without copies); the long window's 2260 keys run wgmma's one-block
    build (176-key tiles at head_dim 128, the last one partial)."""
    from pictor_diffusers.cuda.geometry import Window

    query, key, value = _inputs(2, 3, 300, seq_k, dtype, seed=11, head_dim=head_dim)
    _skip_unless_runs(kernel, query, key, value)
    window = Window(3, 150, 40, k_stop)
    out, lse = _launch(kernel, query, key, value, window)
    rows, keys = slice(window.q_start, window.q_stop), slice(window.k_start, window.k_stop)
    inner = (query[:, :, rows].contiguous(), key[:, :, keys].contiguous(), value[:, :, keys].contiguous())
    assert (out[:, rows].double() - attention_float64(*inner)).abs().max().item() <= bound
    assert (lse[:, rows].double() - lse_float64(inner[0], inner[1])).abs().max().item() <= LSE_MAX_ABS
    outside = torch.cat([out[:, :3], out[:, 150:]], dim=1)
    assert outside.isnan().all(), "a window wrote rows outside it"
    assert torch.cat([lse[:, :3], lse[:, 150:]], dim=1).isnan().all()


def test_public_attention_returns_lse() -> None:
    from pictor_diffusers import attention

    query, key, value = _inputs(1, 2, 77, 300, torch.float32, seed=5)
    out, lse = attention(query, key, value, return_lse=True)
    assert (lse.double() - lse_float64(query, key)).abs().max().item() <= LSE_MAX_ABS
    assert torch.equal(out, attention(query, key, value))
