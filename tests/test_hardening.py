"""CPU tests of the argument hardening: extents the kernels index in 32 bits, argument types, the launch
argument packer, the KV cache's cached values, the cache command, and "auto" on GPUs without a tuned
kernel (a faked device capability). Each error must name the value it rejects."""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import pytest
import torch
from cache_helpers import BUILT, Build, entry, is_valid, plant, use_folders

from pictor_diffusers import attention, cache
from pictor_diffusers.cuda import cubin_cache, nvrtc, plan, runtime, tensor_maps
from pictor_diffusers.integration.kv_cache import KvRequest, kv_attention
from pictor_diffusers.ops.validation import MAX_PLANES, MAX_SEQ


def expanded(batch: int, heads: int, seq: int, head_dim: int = 8) -> torch.Tensor:
    """A `[B, H, N, D]` view with no memory behind its size (stride 0), as a careless caller might pass."""
    return torch.randn(1, 1, 1, head_dim).expand(batch, heads, seq, head_dim)


@pytest.mark.parametrize("seq", [MAX_SEQ + 1, 2**32 + 5], ids=["2^31", "2^32+5"])
@pytest.mark.parametrize("which", ["query", "keys"])
def test_sequences_the_kernels_cannot_index_are_refused(which: str, seq: int) -> None:
    small = expanded(1, 1, 4)
    q, kv = (expanded(1, 1, seq), small) if which == "query" else (small, expanded(1, 1, seq))
    with pytest.raises(ValueError, match=f"N{'q' if which == 'query' else 'k'}={seq}"):
        attention(q, kv, kv)


def test_planes_the_kernels_cannot_index_are_refused() -> None:
    heads = MAX_PLANES // 65535 + 1
    q = expanded(65535, heads, 1)
    with pytest.raises(ValueError, match=f"B \\* H = 65535 \\* {heads}"):
        attention(q, q, q)


@pytest.mark.parametrize("scale", ["0.5", True, None.__class__, [0.5]], ids=["str", "bool", "type", "list"])
def test_scale_must_be_a_real_number(scale: object) -> None:
    q = torch.randn(1, 1, 3, 8)
    with pytest.raises(TypeError, match=re.escape(f"scale must be a real number, got {scale!r}")):
        attention(q, q, q, scale)


@pytest.mark.parametrize("flag", ["no", 1, None])
def test_return_lse_must_be_a_bool(flag: object) -> None:
    q = torch.randn(1, 1, 3, 8)
    with pytest.raises(TypeError, match=f"return_lse must be True or False, got {flag!r}"):
        attention(q, q, q, return_lse=flag)


def test_numpy_and_int_scales_still_work() -> None:
    import numpy as np

    q = torch.randn(1, 2, 5, 8)
    expected = attention(q, q, q, 0.25)
    assert torch.equal(attention(q, q, q, np.float32(0.25)), expected)
    assert torch.equal(attention(q, q, q, 1), attention(q, q, q, 1.0))


@pytest.mark.parametrize(
    ("kind", "value"),
    [(ctypes.c_uint32, 2**32 + 5), (ctypes.c_uint32, -1), (ctypes.c_int32, 2**31), (ctypes.c_uint64, 2**64)],
)
def test_the_argument_packer_never_truncates(kind: type, value: int) -> None:
    slots = runtime._ArgSlots((ctypes.c_uint64, kind))
    with pytest.raises(OverflowError, match=f"kernel argument 1 = {value} does not fit {kind.__name__}"):
        slots.fill((0, value))
    slots.fill((0, 7))
    assert slots.values[1].value == 7


class Cache:
    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.pair = (key, value)

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pair


def cached_call(value: torch.Tensor) -> None:
    q = torch.randn(1, 2, 6, 8)
    k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    request = KvRequest("cached", Cache(torch.randn(1, 3, 2, 8), value), text_len=2, ref_len=3)
    kv_attention(request, q, k, v, torch.float32, "auto")


@pytest.mark.parametrize(
    ("value", "error", "named"),
    [
        (torch.randn(1, 1, 2, 8), ValueError, r"values of shape \(1, 1, 2, 8\)"),
        (torch.randn(1, 3, 1, 8), ValueError, r"values of shape \(1, 3, 1, 8\)"),
        (torch.randn(1, 3, 2, 8, dtype=torch.float64), TypeError, "values of dtype torch.float64"),
        (torch.randn(1, 3, 2, 8, dtype=torch.bfloat16), TypeError, "values of dtype torch.bfloat16"),
        (torch.empty(1, 3, 2, 8, device="meta"), ValueError, "values on meta"),
    ],
    ids=["broadcastable", "one-head", "float64", "mixed", "device"],
)
def test_a_wrong_cached_value_is_refused(value: torch.Tensor, error: type, named: str) -> None:
    with pytest.raises(error, match=named):
        cached_call(value)


def test_the_cache_command_shows_and_clears(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    primary, _ = use_folders(monkeypatch, tmp_path)
    assert cubin_cache.cached_binary("kernel", "key", Build(), is_valid) == BUILT
    stale = plant(primary / ".kernel.cubin.dead.tmp", b"partial")
    assert cache.main([]) == 0
    assert f"{primary}: holds 1 kernel binaries" in capsys.readouterr().out
    assert cache.main(["--clear"]) == 0
    assert f"{primary}: removed 1 kernel binaries" in capsys.readouterr().out
    assert not entry(primary).exists() and not stale.exists()
    os.chmod(primary, 0o777)
    assert cache.main([]) == 1 and "writable by group or others" in capsys.readouterr().err


def test_the_cache_command_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    primary, fallback = use_folders(monkeypatch, tmp_path)
    assert cache.main([]) == 0 and "no cache" in capsys.readouterr().out
    assert not primary.exists() and not fallback.exists()


@pytest.mark.parametrize(
    ("capability", "head_dim", "lse", "expected"),
    [
        ((10, 0), 128, False, "sdpa"),
        ((12, 0), 64, False, "sdpa"),
        ((8, 0), 128, False, "sdpa"),
        ((8, 9), 128, False, "sdpa"),
        ((9, 0), 96, False, "sdpa"),
        ((9, 0), 64, False, "wgmma"),
        ((10, 0), 128, True, "mma16"),
    ],
)
def test_auto_on_a_gpu_without_a_tuned_kernel(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], head_dim: int, lse: bool, expected: str
) -> None:
    """16-bit "auto" on a (faked) device: SDPA unless a kernel measured faster than SDPA there runs it."""
    monkeypatch.setattr(nvrtc, "device_facts", lambda index: (capability, 232448))
    monkeypatch.setattr(nvrtc, "function", lambda variant, index: 0)
    monkeypatch.setattr(tensor_maps, "check_driver", lambda: None)
    monkeypatch.setattr(plan, "_resolved", {})
    selection = plan.resolve("auto", torch.bfloat16, torch.bfloat16, head_dim, 0, True, lse=lse).selection
    assert (selection.delegate or selection.variant.spec.name) == expected
    parity = plan.resolve("auto", torch.float32, torch.float32, head_dim, 0, True).selection
    assert parity.delegate is None and parity.variant.spec.family == "fp32", "the parity path left its kernels"
