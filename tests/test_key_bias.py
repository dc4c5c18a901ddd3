"""A bias per key (`attention(..., key_bias=)`): SDPA's float `attn_mask` when it is the same for every query row.

The truth is float64 SDPA with the bias as its `[B, 1|H, 1, Nk]` mask, on the same rounded inputs. Bias patterns:
N(0, 3²) biases, key padding by -inf with whole leading and trailing key tiles dropped (a row's first tiles then
have no finite score), LTX-Video's -10000, a row of only -inf keys (output 0, LSE -inf, as SDPA's safe softmax
gives), finfo.min on every key of a batch (finite: its keys weigh alike, as in SDPA). Key counts are no multiple
of the kernels' 128- or 176-key tiles, and below one tile. On CPU the twin runs; on CUDA the wgmma kernel's
key-bias builds (persistent and one-block, head_dim 64 and 128, bf16 and fp16), bounded by SDPA's own 16-bit error
on the same call, with no host sync; and through a plan into an output poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pictor_diffusers import attention
from pictor_diffusers.cuda.plan import cannot_run
from pictor_diffusers.testing.references import random_qkv

PATTERNS = ["normal", "padding", "ltx", "empty-row", "finfo-min"]
# (B, H, Nq, Nk): the persistent builds (at most 2048 keys): Nk not a multiple of 128, Nk below one tile; the
# one-block builds: 2300 keys, 13 tiles of 176 (head_dim 128) and a partial one.
SHAPES = [(2, 3, 77, 300), (1, 2, 200, 45), (2, 2, 150, 2300)]
_ID = "B{}-H{}-Nq{}-Nk{}".format


def make_bias(pattern: str, batch: int, heads: int, seq_k: int, per_head: bool, device: str) -> torch.Tensor:
    """A float32 `[B, 1 or H, Nk]` bias of `pattern` (see the module's docstring); batch 0 always keeps keys."""
    generator = torch.Generator().manual_seed(seq_k * 3 + batch)
    shape = (batch, heads if per_head else 1, seq_k)
    bias = torch.randn(shape, generator=generator) * 3 if pattern == "normal" else torch.zeros(shape)
    dropped = {"padding": float("-inf"), "ltx": -10000.0, "empty-row": float("-inf")}.get(pattern)
    if dropped is not None:
        keep = seq_k // 3
        bias[0, :, : seq_k // 2 - keep // 2] = dropped  # leading tiles without a finite score
        bias[0, :, seq_k // 2 + keep // 2 + 1 :] = dropped
        if batch > 1:
            bias[1:, :, -(seq_k // 5) :] = dropped
    if pattern == "empty-row" and batch > 1:
        bias[-1, :, :] = float("-inf")
    if pattern == "finfo-min" and batch > 1:
        bias[-1, :, :] = torch.finfo(torch.bfloat16).min
    return bias.to(device)


def expected(query, key, value, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 SDPA with `bias` as its mask, token-major `[B, Nq, H*D]`, and the LSE `[B, Nq, H]`; rows whose keys
    are all -inf: 0 and -inf."""
    q, k, v = (t.double() for t in (query, key, value))
    mask = bias.double().unsqueeze(2)
    logits = q @ k.transpose(-1, -2) * query.shape[-1] ** -0.5 + mask
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = weights @ v
    batch, heads, seq_q, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq_q, heads * head_dim), lse.transpose(1, 2)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    batch, heads, seq_q, seq_k, head_dim = shape
    query = random_qkv(batch, heads, seq_q, head_dim, seed=seq_q, device=device)[0].to(dtype)
    key, value = (t.to(dtype) for t in random_qkv(batch, heads, seq_k, head_dim, seed=seq_k, device=device)[1:])
    return query, key, value


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: _ID(*s))
def test_cpu_twin(shape: tuple[int, ...], pattern: str, per_head: bool) -> None:
    """The CPU path in float32 within 1e-5 of float64 (output and LSE), empty rows exactly 0 and -inf."""
    query, key, value = inputs((*shape, 40), torch.float32, "cpu")
    bias = make_bias(pattern, shape[0], shape[1], shape[3], per_head, "cpu")
    out, lse = attention(query, key, value, key_bias=bias, return_lse=True)
    want, want_lse = expected(query, key, value, bias)
    assert (out.double() - want).abs().max() <= 1e-5
    finite = want_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse[finite].double() - want_lse[finite]).abs().max() <= 1e-5
    if pattern == "empty-row" and shape[0] > 1:
        assert (out[-1] == 0).all() and (lse[-1] == float("-inf")).all()


def test_key_bias_is_checked() -> None:
    query, key, value = inputs((2, 3, 5, 7, 16), torch.float32, "cpu")
    wrong_shape = r"key_bias must be \[B, 1 or H, Nk\] = \[2, 1 or 3, 7\], got shape \(2, 2, 7\)"
    with pytest.raises(ValueError, match=wrong_shape):
        attention(query, key, value, key_bias=torch.zeros(2, 2, 7))
    with pytest.raises(TypeError, match=r"floating-point tensor, got torch\.int64"):
        attention(query, key, value, key_bias=torch.zeros(2, 1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="key_bias is on meta but query is on cpu"):
        attention(query, key, value, key_bias=torch.zeros(2, 1, 7, device="meta"))
    with pytest.raises(ValueError, match="key_bias and key_lens cannot be given together"):
        attention(query, key, value, key_bias=torch.zeros(2, 1, 7), key_lens=torch.tensor([7, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="kernel='int8' takes no key_bias"):
        attention(*inputs((1, 1, 5, 7, 128), torch.bfloat16, "cpu"), key_bias=torch.zeros(1, 1, 7), kernel="int8")


def sdpa16_error(query, key, value, bias: torch.Tensor, want: torch.Tensor, rows: torch.Tensor) -> float:
    """Max-abs error of torch's SDPA in the inputs' dtype (its mask in that dtype too) over `rows`."""
    finite = bias.clamp(min=torch.finfo(query.dtype).min)  # finfo(bfloat16).min is -inf in float16
    mask = torch.where(bias.isneginf(), bias, finite).unsqueeze(2).to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    batch, heads, seq_q, head_dim = out.shape
    out = out.transpose(1, 2).reshape(batch, seq_q, heads * head_dim)
    return (out.double() - want)[rows].abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: _ID(*s))
def test_wgmma_key_bias(shape, pattern: str, per_head: bool, head_dim: int, dtype: torch.dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    query, key, value = inputs((*shape, head_dim), dtype, "cuda")
    reason = cannot_run("wgmma", query, key, value)
    if reason is not None:
        pytest.skip(f"wgmma cannot run here: {reason}")
    bias = make_bias(pattern, shape[0], shape[1], shape[3], per_head, "cuda")
    want, want_lse = expected(query, key, value, bias)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = attention(query, key, value, key_bias=bias, return_lse=True, kernel="wgmma")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    finite = want_lse.isfinite()  # [B, Nq, H]
    rows = finite.all(-1)  # [B, Nq]: rows with a finite key in every head
    assert torch.equal(lse.isfinite(), finite), "rows of only -inf keys must have LSE -inf, the others finite"
    assert not out.isnan().any() and (out[~rows] == 0).all(), "rows of only -inf keys must be 0"
    error = (out.double() - want)[rows].abs().max().item()
    bound = 2.0 * sdpa16_error(query, key, value, bias, want, rows) + 1e-5
    print(f"KEY_BIAS {pattern} {_ID(*shape)} D{head_dim} {dtype}: max-abs {error:.2e} (bound {bound:.2e})")
    assert error <= bound
    saturated = want_lse < -torch.finfo(torch.float32).max * 0.6931  # the finfo-min rows, in log2 units past -FLT_MAX
    assert (lse[finite & ~saturated].double() - want_lse[finite & ~saturated]).abs().max() <= 1e-2
    assert (lse[saturated] <= -torch.finfo(torch.float32).max * 0.69).all()


@pytest.mark.gpu
@pytest.mark.parametrize("seq_k", [181, 2300])
def test_wgmma_key_bias_writes_every_row(seq_k: int) -> None:
    """Into an output poisoned with NaN: every row written (the rows of only -inf keys too), through a plan, by the
    persistent build (181 keys) and the one-block build (2300)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pictor_diffusers.cuda.launch import run
    from pictor_diffusers.cuda.plan import plan_attention

    query, key, value = inputs((2, 3, 333, seq_k, 128), torch.bfloat16, "cuda")
    reason = cannot_run("wgmma", query, key, value)
    if reason is not None:
        pytest.skip(f"wgmma cannot run here: {reason}")
    bias = make_bias("empty-row", 2, 3, seq_k, False, "cuda")
    out = torch.full((2, 333, 3 * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan = plan_attention(query, key, value, 128**-0.5, "wgmma", torch.bfloat16, out=out, key_bias=bias)
    assert plan.selection.variant.key_bias and plan.selection.variant.persistent == (seq_k <= 2048)
    run(plan)
    want, _ = expected(query, key, value, bias)
    assert not out.isnan().any() and (out[1] == 0).all()
    assert (out[0].double() - want[0]).abs().max() <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [4, 12], ids=["8-bytes-in", "24-bytes-in"])
def test_wgmma_key_bias_copies_rows_that_are_not_aligned(offset: int) -> None:
    """q, k and v whose rows start off 16-byte boundaries (views `offset` bf16 elements into their storage, as
    a compiled graph may hand the op): the key-bias build runs on aligned copies, the result that of aligned
    inputs, bit for bit (the key-bias builds read rows through TMA, which needs 16-byte alignment)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    aligned = inputs((2, 3, 77, 300, 128), torch.bfloat16, "cuda")
    reason = cannot_run("wgmma", *aligned)
    if reason is not None:
        pytest.skip(f"wgmma cannot run here: {reason}")
    shifted = []
    for tensor in aligned:
        storage = torch.full((tensor.numel() + offset,), float("nan"), dtype=tensor.dtype, device="cuda")
        view = storage[offset:].view(tensor.shape)
        view.copy_(tensor)
        shifted.append(view)
    assert all(t.data_ptr() % 16 for t in shifted)
    bias = make_bias("padding", 2, 3, 300, True, "cuda")
    want = attention(*aligned, key_bias=bias)
    assert torch.equal(attention(*shifted, key_bias=bias), want)


def test_log2_key_bias_layout() -> None:
    """The kernel's operand: float32 `[B * H, k_pad]`, the window's keys times log2(e), heads broadcast, zeros past
    the keys; infinities and NaN kept, finite values beyond float32's range in log2 units clamped to +-FLT_MAX."""
    from pictor_diffusers.cuda.geometry import LOG2_E, Window
    from pictor_diffusers.cuda.plan import log2_key_bias

    big, large = torch.finfo(torch.float32).max, torch.finfo(torch.bfloat16).max  # large * log2(e) > big
    bias = torch.tensor([[[1.0, float("-inf"), float("inf"), -large, large, float("nan"), -2.0, 0.5, 3.0]]])
    bias = torch.cat([bias, -bias], dim=0).bfloat16()  # [2, 1, 9]
    padded = log2_key_bias(bias, 3, Window(0, 5, 2, 9), 4)  # keys 2..8 of 9, tiles of 4
    assert padded.shape == (6, 8) and padded.dtype == torch.float32
    keys = bias.float()[:, 0, 2:9]
    expected = torch.where(keys.isinf(), keys, (keys * LOG2_E).clamp(-big, big))
    for plane in range(6):
        torch.testing.assert_close(padded[plane, :7], expected[plane // 3], equal_nan=True, rtol=0, atol=0)
        assert (padded[plane, 7:] == 0).all()
    assert padded[0, 1] == -big and padded[0, 2] == big  # finite values past float32's range in log2 units
