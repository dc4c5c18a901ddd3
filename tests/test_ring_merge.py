"""Ring attention's merge: per-shard attention with the log-sum-exp, folded by `ring.merge_partial`,
equals attention over all keys.

This is one rank's ring loop without the exchange (the exchange is tested on CPU with gloo in
tests/test_context_parallel.py; one GPU cannot host two NCCL ranks). The keys are split into uneven
shards, none a multiple of any kernel's tile, one of a single key; each shard's partial output is
written in the kernel's output dtype, the merge runs in float32, and the result is compared with
float64 attention over every key, in the same bounds as one launch (tests/test_gpu_windows.py).
"""

from __future__ import annotations

import pytest
import torch

from pictor_diffusers import attention
from pictor_diffusers.integration.ring import merge_partial
from pictor_diffusers.testing.references import attention_float64, lse_float64

# device, kernel, input dtype, output max-abs bound against float64.
CASES = [
    ("cpu", "auto", torch.float32, 1e-5),
    pytest.param("cuda", "f32", torch.float32, 1e-5, marks=pytest.mark.gpu),
    pytest.param("cuda", "tf32x3", torch.float32, 1e-5, marks=pytest.mark.gpu),
    pytest.param("cuda", "fp16x3", torch.float32, 1e-5, marks=pytest.mark.gpu),
    pytest.param("cuda", "wgmma", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),
    pytest.param("cuda", "wgmma", torch.float16, 4e-3, marks=pytest.mark.gpu),
    pytest.param("cuda", "mma16", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),
]
LSE_MAX_ABS = 1e-5
# (B, H, Nq, key shard lengths)
SHAPES = [(1, 3, 200, (700, 301, 1)), (2, 2, 129, (77, 77)), (1, 4, 1025, (513, 1000, 130, 64))]


def _merged(query: torch.Tensor, shards: list[tuple[torch.Tensor, torch.Tensor]], kernel: str):
    out = lse = None
    for key, value in shards:
        part, part_lse = attention(query, key, value, kernel=kernel, return_lse=True)
        out, lse = merge_partial(out, lse, part, part_lse)
    return out, lse


@pytest.mark.parametrize(("device", "kernel", "dtype", "bound"), CASES)
@pytest.mark.parametrize(("batch", "heads", "seq_q", "lengths"), SHAPES)
def test_merged_shards_equal_attention_over_all_keys(
    device: str, kernel: str, dtype: torch.dtype, bound: float, batch: int, heads: int, seq_q: int, lengths: tuple
) -> None:
    from pictor_diffusers.cuda.plan import cannot_run

    generator = torch.Generator(device=device).manual_seed(seq_q + sum(lengths))
    query = torch.randn(batch, heads, seq_q, 128, device=device, generator=generator).to(dtype)
    key, value = (
        torch.randn(batch, heads, sum(lengths), 128, device=device, generator=generator).to(dtype) for _ in "kv"
    )
    if device == "cuda" and (reason := cannot_run(kernel, query, key, value, dtype)) is not None:
        pytest.skip(reason)
    shards = list(zip(key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True))
    out, lse = _merged(query, [(k.contiguous(), v.contiguous()) for k, v in shards], kernel)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (batch, seq_q, heads, 128) and lse.shape == (batch, seq_q, heads)
    error = (
        (out.reshape(batch, seq_q, -1).double() - attention_float64(query, key, value).to(device)).abs().max().item()
    )
    lse_error = (lse.double() - lse_float64(query, key).to(device)).abs().max().item()
    assert error <= bound, f"merged output max-abs {error:.3e} > {bound:.0e}"
    assert lse_error <= LSE_MAX_ABS, f"merged LSE max-abs {lse_error:.3e} > {LSE_MAX_ABS:.0e}"
