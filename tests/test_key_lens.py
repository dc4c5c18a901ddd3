"""Per-batch key counts (`attention(..., key_lens=)`): what a key-padding mask becomes.

Batch b attends only its first `key_lens[b]` keys. Checked against float64 attention over exactly those
keys, per batch: on CPU (the reference path) always, and on every CUDA kernel where a GPU is present.
Counts cover every key, one key, a count that is no multiple of any kernel's key tile, and none (rows
of 0, LSE -inf, as torch's SDPA gives a row whose keys are all masked); out-of-range counts are clamped.
The "more-work-tiles-than-SMs" case has more work tiles (360 of 128 rows, 240 of 192 at head_dim 64) than an
H100 or H200 has SMs, so each block of a persistent kernel takes several, across batches with and without keys;
the last attends more than `registry.SHORT_KEYS` keys, so the wgmma kernel's other build (one block per work
tile) meets a batch without keys; "long-keys-176-key-tile-edges" gives that build at head_dim 128 (176-key tiles)
counts of one key past a tile (177) and of whole tiles (2112 = 12 x 176) beside a batch without keys. The CUDA
kernels run at head_dim 128 and 64 (where they can).
CUDA outputs and LSE are poisoned with a finite sentinel before the launch, so a row left unwritten fails.
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import attention
from pictor_diffusers.testing.references import attention_float64, lse_float64

# (B, H, Nq, Nk, key counts): counts past Nk or below 0 are clamped to [0, Nk].
CASES = [
    (3, 2, 37, 300, [300, 129, 1]),
    (4, 3, 200, 1000, [0, 1000, 77, 513]),
    (2, 1, 129, 131, [131 + 40, -3]),
    (3, 40, 300, 700, [700, 0, 333]),
    (2, 2, 150, 2100, [0, 2077]),
    (4, 2, 300, 4097, [4097, 0, 177, 2112]),
]
CASE_IDS = [
    "partial", "none-full-partial", "clamped", "more-work-tiles-than-SMs", "long-keys-none-partial",
    "long-keys-176-key-tile-edges",
]  # fmt: skip
SENTINEL = 12345.0
# kernel, input dtype, output max-abs bound against float64 on the rounded inputs, LSE bound.
KERNELS = [
    ("f32", torch.float32, 1e-5, 1e-5),
    ("tf32x3", torch.float32, 1e-5, 1e-5),
    ("fp16x3", torch.float32, 1e-5, 1e-5),
    ("wgmma", torch.bfloat16, 2e-2, 1e-2),
    ("wgmma", torch.float16, 4e-3, 1e-2),
    ("mma16", torch.bfloat16, 2e-2, 1e-2),
    ("mma16", torch.float16, 4e-3, 1e-2),
]


def _inputs(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype: torch.dtype, device: str):
    generator = torch.Generator(device=device).manual_seed(seq_q * 7 + seq_k)
    shapes = [(batch, heads, seq_q, head_dim)] + [(batch, heads, seq_k, head_dim)] * 2
    return [torch.randn(s, generator=generator, device=device).to(dtype) for s in shapes]


def _check(out: torch.Tensor, lse: torch.Tensor, query, key, value, counts: list[int], bound: float, lse_bound: float):
    for b, count in enumerate(counts):
        kept = min(max(count, 0), key.shape[2])
        if kept == 0:
            assert (out[b] == 0).all(), f"batch {b} has no keys: its rows must be 0"
            assert lse[b].isneginf().all(), f"batch {b} has no keys: its LSE must be -inf"
            continue
        sliced = (query[b : b + 1], key[b : b + 1, :, :kept], value[b : b + 1, :, :kept])
        error = (out[b : b + 1].double() - attention_float64(*sliced)).abs().max().item()
        lse_error = (lse[b : b + 1].double() - lse_float64(*sliced[:2])).abs().max().item()
        assert error <= bound, f"batch {b} ({kept} keys): max-abs {error:.3e} > {bound:.1e}"
        assert lse_error <= lse_bound, f"batch {b} ({kept} keys): LSE max-abs {lse_error:.3e} > {lse_bound:.1e}"


@pytest.mark.parametrize("head_dim", [16, 40])
@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k", "counts"), CASES, ids=CASE_IDS)
def test_cpu_reference(batch: int, heads: int, seq_q: int, seq_k: int, counts: list[int], head_dim: int) -> None:
    query, key, value = _inputs(batch, heads, seq_q, seq_k, head_dim, torch.float32, "cpu")
    key_lens = torch.tensor(counts, dtype=torch.int32)
    out, lse = attention(query, key, value, key_lens=key_lens, return_lse=True)
    _check(out, lse, query, key, value, counts, 1e-5, 1e-5)


def test_key_lens_is_checked() -> None:
    query, key, value = _inputs(2, 1, 5, 7, 8, torch.float32, "cpu")
    with pytest.raises(TypeError, match=r"key_lens must be int32, got torch\.int64"):
        attention(query, key, value, key_lens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"contiguous \[B\] = \[2\] tensor, got shape \(3,\)"):
        attention(query, key, value, key_lens=torch.tensor([1, 2, 3], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])
@pytest.mark.parametrize(("kernel", "dtype", "bound", "lse_bound"), KERNELS, ids=[f"{k[0]}-{k[1]}" for k in KERNELS])
@pytest.mark.parametrize(("batch", "heads", "seq_q", "seq_k", "counts"), CASES, ids=CASE_IDS)
def test_cuda_kernels(
    batch, heads, seq_q, seq_k, counts, kernel: str, dtype, bound: float, lse_bound: float, head_dim: int
) -> None:
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import cannot_run, plan_attention

    query, key, value = _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, "cuda")
    out_dtype = query.dtype
    reason = cannot_run(kernel, query, key, value, out_dtype)
    if reason is not None:
        pytest.skip(reason)
    out = torch.full((batch, seq_q, heads * head_dim), SENTINEL, device="cuda", dtype=out_dtype)
    lse = torch.full((batch, seq_q, heads), SENTINEL, device="cuda")
    key_lens = torch.tensor(counts, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    run(plan_attention(query, key, value, scale, kernel, out_dtype, out=out, lse=lse, key_lens=key_lens))
    torch.cuda.synchronize()
    assert not (out == SENTINEL).any() and not (lse == SENTINEL).any(), "rows left unwritten"
    _check(out, lse, query, key, value, counts, bound, lse_bound)
