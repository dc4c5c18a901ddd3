"""The host fast path (`cuda.plan_memo`): a repeated call replays its plan, and a replay is as right as the
first call.

* a call that repeats a served one (same addresses, shapes, strides, dtypes) is replayed: one entry, the same
  kernel launched (counted), new data at the same addresses read (fp16x3: split again, into a workspace freed
  as poison), a NaN-poisoned output block overwritten;
* another stride, dtype, shape, scale or kernel is a new entry; what the memo may not serve (LSE, key counts,
  copies of strided inputs) is never remembered;
* a replay skips no check that could fail: a bad argument next to remembered tensors still raises;
* the memo keeps no tensor alive; calls with LSE, unchecked argument types or autograd get no key;
* key counts are replayed with their current values.
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict

import pytest
import torch
from launch_counts import count_launches

from pictor_diffusers import attention
from pictor_diffusers.cuda import plan_memo
from pictor_diffusers.ops.attention import memo_key
from pictor_diffusers.testing.references import attention_float64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(1, 3, 77, 128), (2, 4, 300, 64), (1, 2, 129, 128)]
"""Odd token counts: partial query blocks and key tiles."""
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_memo, "_memo", OrderedDict())


def fresh(shape: tuple[int, ...], dtype: torch.dtype, seed: int, token_major: bool = False) -> list[torch.Tensor]:
    """q, k, v N(0, 1) in `dtype`, head-major, or `[B, N, H, D]` storage seen as `[B, H, N, D]`."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    batch, heads, seq, head_dim = shape
    stored = (batch, seq, heads, head_dim) if token_major else shape
    tensors = [torch.randn(stored, generator=generator, device="cuda").to(dtype) for _ in range(3)]
    return [t.transpose(1, 2) for t in tensors] if token_major else tensors


def check(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    torch.cuda.synchronize()
    assert not out.isnan().any(), "a poisoned output row was left unwritten"
    expected = attention_float64(query.double(), key.double(), value.double())
    assert (out.double() - expected).abs().max().item() < TOLERANCE[query.dtype]


def poisoned_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """attention() whose output block the caching allocator last held as NaNs (the block is reused)."""
    batch, heads, seq, head_dim = query.shape
    sentinel = torch.full((batch, seq, heads * head_dim), float("nan"), dtype=query.dtype, device="cuda")
    del sentinel
    return attention(query, key, value, **kwargs)


@pytest.mark.parametrize("token_major", [False, True], ids=["head-major", "token-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_replay_reads_new_data_and_writes_every_row(
    shape: tuple[int, ...], dtype: torch.dtype, token_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    query, key, value = fresh(shape, dtype, seed=1, token_major=token_major)
    first = poisoned_call(query, key, value)
    check(first, query, key, value)
    entries = plan_memo.remembered()
    launches = count_launches(monkeypatch, "16bit" if dtype != torch.float32 else "fp32")
    for seed in (2, 3):
        for tensor, new in zip((query, key, value), fresh(shape, dtype, seed, token_major), strict=True):
            tensor.copy_(new)
        check(poisoned_call(query, key, value), query, key, value)
    assert plan_memo.remembered() == entries, "a repeated call must not add entries"
    if launches[0]:
        assert entries == 1, "a kernel call must be remembered (fp16x3's with its split prepass)"
    assert launches[0] in (0, 2), f"{launches[0]} kernel launches for 2 calls"
    assert launches[0] or entries == 0, "a remembered call must launch its kernel"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_different_fact_is_a_new_entry(dtype: torch.dtype) -> None:
    query, key, value = fresh((1, 3, 77, 128), dtype, seed=4)
    attention(query, key, value)
    base = plan_memo.remembered()
    if base == 0:
        pytest.skip("this GPU's auto choice for these inputs is SDPA, which is not remembered")
    attention(query, key, value, scale=0.05)
    attention(query[:, :, :70].contiguous(), key, value)  # contiguous: the f32 kernels would copy a slice
    attention(query, key[:, :, :50].contiguous(), value[:, :, :50].contiguous())
    assert plan_memo.remembered() == base + 3
    out = attention(query, key, value, scale=0.05)
    rescaled = query.double() * (0.05 * 128**0.5)  # attention_float64 scales logits by D ** -0.5
    expected = attention_float64(rescaled, key.double(), value.double())
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


def test_calls_the_memo_may_not_serve_are_not_remembered() -> None:
    query, key, value = fresh((2, 3, 77, 128), torch.bfloat16, seed=5)
    attention(query, key, value, return_lse=True)
    attention(*(t[..., ::2] for t in (query, key, value)))  # strided head_dim: copied before the launch
    assert plan_memo.remembered() == 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_key_counts_replayed_with_their_current_values(head_dim: int) -> None:
    """The backend passes one cached key-count tensor for every call under a mask: a replay reads its values."""
    query, key, value = fresh((2, 3, 77, head_dim), torch.bfloat16, seed=9)
    key_lens = torch.tensor([77, 40], dtype=torch.int32, device="cuda")
    for counts in ([77, 40], [13, 77], [1, 50]):
        key_lens.copy_(torch.tensor(counts, dtype=torch.int32))
        out = poisoned_call(query, key, value, key_lens=key_lens)
        torch.cuda.synchronize()
        for b, count in enumerate(counts):
            part = (query[b : b + 1], key[b : b + 1, :, :count], value[b : b + 1, :, :count])
            check(out[b : b + 1], *part)
    assert plan_memo.remembered() <= 1


@pytest.mark.parametrize("key_lens", [False, True], ids=["all-keys", "key-counts"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp16x3_replay_splits_new_data_into_a_poisoned_workspace(out_dtype: torch.dtype, key_lens: bool) -> None:
    """float32 q, k, v at head_dim 128 on the fp16x3 kernel (Hopper): the first call is remembered with its split
    prepass, and each replay splits the new data again into a workspace whose freed block was poisoned (maxima
    huge: they must be zeroed again), into an output block freed as NaN; Nq != Nk, a bf16 output and key counts
    too; within 1e-5 of float64 (the bf16 output: 1e-2)."""
    from pictor_diffusers.cuda.geometry import split_halves
    from pictor_diffusers.cuda.plan import cannot_run

    query = fresh((2, 3, 77, 128), torch.float32, seed=11)[0]
    key, value = fresh((2, 3, 300, 128), torch.float32, seed=12)[:2]
    reason = cannot_run("fp16x3", query, key, value, out_dtype)
    if reason is not None:
        pytest.skip(f"the fp16x3 kernel cannot run here: {reason}")
    lens = torch.tensor([300, 123], dtype=torch.int32, device="cuda") if key_lens else None
    workspace = split_halves(6, 77, 300, 128) + 6 * 6 * 128  # float16 elements: planes, then the maxima
    for seed in (13, 14, 15):
        poison = [
            torch.full((workspace,), 65504.0, dtype=torch.float16, device="cuda"),  # maxima bits 0x7BFF7BFF
            torch.full((2, 77, 3 * 128), float("nan"), dtype=out_dtype, device="cuda"),
        ]
        del poison
        out = attention(query, key, value, kernel="fp16x3", out_dtype=out_dtype, key_lens=lens)
        torch.cuda.synchronize()
        for b, count in enumerate([300, 123] if key_lens else [300, 300]):
            expected = attention_float64(query[b : b + 1], key[b : b + 1, :, :count], value[b : b + 1, :, :count])
            error = (out[b : b + 1].double() - expected).abs().max().item()
            assert error < (1e-5 if out_dtype == torch.float32 else 1e-2), f"batch {b}: max-abs {error:.2e}"
        news = [fresh((2, 3, n, 128), torch.float32, seed)[0] for n in (77, 300, 300)]
        for tensor, new in zip((query, key, value), news, strict=True):
            tensor.copy_(new)
    assert plan_memo.remembered() == 1


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"scale": True}, TypeError),
        ({"scale": -1.0}, ValueError),
        ({"kernel": "tf32x3"}, ValueError),
        ({"out_dtype": torch.float32}, ValueError),
    ],
    ids=["bool-scale", "negative-scale", "kernel-of-another-family", "out-dtype"],
)
def test_checks_still_run_next_to_remembered_tensors(bad: dict, error: type) -> None:
    query, key, value = fresh((1, 3, 77, 128), torch.bfloat16, seed=6)
    attention(query, key, value)
    attention(query, key, value)
    with pytest.raises(error):
        attention(query, key, value, **bad)
    with pytest.raises((TypeError, ValueError)):
        attention(query, key.float(), value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_memo_keeps_no_tensor_alive(dtype: torch.dtype) -> None:
    """Neither a prepared launch nor a split replay (float32 at head_dim 128 on Hopper: fp16x3) holds a tensor."""
    query, key, value = fresh((1, 3, 77, 128), dtype, seed=7)
    key_lens = torch.tensor([50], dtype=torch.int32, device="cuda")
    out = attention(query, key, value, key_lens=key_lens)
    plain = attention(query, key, value)
    refs = [weakref.ref(t) for t in (query, key, value, out, key_lens, plain)]
    del query, key, value, out, key_lens, plain
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize(
    "change",
    [
        {"return_lse": True},
        {"return_lse": 1},
        {"kernel": ["auto"]},
        {"scale": 1},
        {"scale": True},
        {"out_dtype": "bfloat16"},
        {"requires_grad": True},
    ],
    ids=["lse", "lse-int", "kernel-list", "int-scale", "bool-scale", "out-dtype-str", "autograd"],
)
def test_no_fast_path_offered(change: dict) -> None:
    """No key for these CUDA calls (LSE, argument types the checks refuse, recorded autograd);
    the unchanged call gets one."""
    args = {"scale": None, "kernel": "auto", "out_dtype": None, "return_lse": False, "key_lens": None}
    q, k, v = fresh((2, 3, 17, 64), torch.bfloat16, seed=8)
    assert memo_key(q, k, v, **args) is not None
    change = dict(change)
    if change.pop("requires_grad", False):
        q.requires_grad_(True)
    assert memo_key(q, k, v, **{**args, **change}) is None


def dispatch(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: object):
    from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn

    with attention_backend(backend):
        return dispatch_attention_fn(query, key, value, **kwargs)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("seq_q", "seq_k"), [(77, 77), (300, 45)])
def test_backend_call_replayed(seq_q: int, seq_k: int, head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """pictor_bf16 on the dispatcher's token-major bf16 q, k, v: a repeated call replays the kernel launch (one
    per call), reading new data and writing every row; f32 inputs (cast copies) and masked calls are not
    remembered under the backend's key."""
    pytest.importorskip("diffusers")
    generator = torch.Generator(device="cuda").manual_seed(10)

    def token_major(seq: int) -> torch.Tensor:
        return torch.randn(2, seq, 3, head_dim, generator=generator, device="cuda").to(torch.bfloat16)

    query, key, value = token_major(seq_q), token_major(seq_k), token_major(seq_k)
    dispatch("pictor_bf16", query, key, value)
    entries = plan_memo.remembered()
    if entries == 0:
        pytest.skip("auto hands these calls to SDPA on this GPU: nothing to replay")
    assert entries == 2, "attention()'s entry and the backend's alias of it"
    launches = count_launches(monkeypatch, "16bit")
    for _ in range(2):
        for tensor in (query, key, value):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda"))
        sentinel = torch.full((2, seq_q, 3 * head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        del sentinel
        out = dispatch("pictor_bf16", query, key, value)
        assert out.shape == query.shape
        check(out.flatten(2), *(t.transpose(1, 2) for t in (query, key, value)))
    assert launches[0] == 2 and plan_memo.remembered() == entries
    dispatch("pictor_bf16", query.float(), key.float(), value.float())
    mask = torch.ones(2, 1, 1, seq_k, dtype=torch.bool, device="cuda")
    mask[1, :, :, seq_k // 2 :] = False
    dispatch("pictor_bf16", query, key, value, attn_mask=mask)
    backend_keys = [call for call in plan_memo._memo if call[0] == "pictor_bf16"]
    assert len(backend_keys) == 1, "a cast or masked call must not be remembered under the backend's key"
