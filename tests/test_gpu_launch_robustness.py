"""Launch paths under conditions that break naive launchers: fresh threads, a
Hopper kernel that cannot be prepared, misaligned outputs."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict

import pytest
import torch

from pictor_diffusers import attention
from pictor_diffusers.cuda import launch, nvrtc, plan, plan_memo
from pictor_diffusers.testing.references import attention_float64, random_qkv

pytestmark = pytest.mark.gpu

SHAPE = (1, 3, 77, 128)  # odd N: partial query block and key tile


@pytest.mark.parametrize("seq", [SHAPE[2], 2100], ids=["short", "long"])
@pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_first_call_in_a_new_thread(dtype: torch.dtype, head_dim: int, seq: int) -> None:
    """A thread that never touched CUDA itself: the launch must bind the device's context (head_dim 64: the
    512-thread wgmma build on Hopper; 2100 tokens: wgmma's one-block build, 176-key tiles at head_dim 128)."""
    query, key, value = (t.to(dtype) for t in random_qkv(*SHAPE[:2], seq, head_dim, seed=3))
    attention(query, key, value)  # compile and load in the main thread first
    torch.cuda.synchronize()
    results: dict[str, object] = {}

    def worker() -> None:
        try:
            results["out"] = attention(query, key, value)
            torch.cuda.synchronize()
        except Exception as error:  # reported to the main thread below
            results["error"] = error

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in results, f"attention() in a new thread raised {results.get('error')!r}"
    expected = attention_float64(query.float(), key.float(), value.float())
    error = (results["out"].double() - expected).abs().max().item()
    assert error < (1e-5 if dtype == torch.float32 else 2e-2), error


def test_auto_moves_on_when_the_hopper_kernel_cannot_be_prepared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed sm_90a build disables wgmma with a warning; "auto" runs mma16 for a call that asks for the
    LSE (SDPA for a plain one), "wgmma" names the failure."""
    query, key, value = (t.to(torch.bfloat16) for t in random_qkv(*SHAPE, seed=4))
    if plan.cannot_run("mma16", query, key, value) is not None:
        pytest.skip("mma16 cannot run here")
    working = nvrtc.function

    def broken_wgmma(variant: object, device_index: int) -> int:
        if variant.spec.name == "wgmma":
            raise RuntimeError("NVRTC failed (simulated)")
        return working(variant, device_index)

    monkeypatch.setattr(nvrtc, "function", broken_wgmma)
    monkeypatch.setattr(plan, "_resolved", {})
    monkeypatch.setattr(plan, "_disabled", {})
    monkeypatch.setattr(plan_memo, "_memo", OrderedDict())  # no replay of a plan resolved before the failure
    hopper = torch.cuda.get_device_capability() == (9, 0)
    with pytest.warns(RuntimeWarning, match="could not be prepared") if hopper else contextlib.nullcontext():
        out, _ = attention(query, key, value, return_lse=True)
    expected = launch.run(plan.plan_attention(query, key, value, 128**-0.5, "mma16", torch.bfloat16))
    assert torch.equal(out, expected)
    plain = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    assert torch.equal(attention(query, key, value), plain.transpose(1, 2).reshape(out.shape))
    if hopper:
        monkeypatch.setattr(plan, "_disabled", {})
        with pytest.raises(ValueError, match=r"kernel='wgmma' cannot run here: .*NVRTC failed \(simulated\)"):
            attention(query, key, value, kernel="wgmma")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_misaligned_out_is_refused(dtype: torch.dtype) -> None:
    query, key, value = (t.to(dtype) for t in random_qkv(*SHAPE, seed=5))
    batch, heads, seq, head_dim = SHAPE
    storage = torch.empty(batch * seq * heads * head_dim + 1, dtype=dtype, device="cuda")
    out = storage[1:].view(batch, seq, heads * head_dim)
    kernel = "tf32x3" if dtype == torch.float32 else "mma16"
    with pytest.raises(ValueError, match="out must be 16-byte aligned"):
        launch.run(plan.plan_attention(query, key, value, head_dim**-0.5, kernel, dtype, out=out))
