"""`plan_memo.call_key` tells apart every fact a launch depends on; CPU calls get no fast path (the replays and
the fast path's other refusals are tested on GPU in `test_gpu_plan_memo.py`)."""

from __future__ import annotations

import torch

from pictor_diffusers.cuda.plan_memo import call_key
from pictor_diffusers.ops.attention import memo_key

BASE = dict(scale=None, kernel="auto", out_dtype=None)


def qkv(shape: tuple[int, ...] = (2, 3, 17, 64), dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    return [torch.randn(shape).to(dtype) for _ in range(3)]


def variants() -> dict[str, tuple]:
    """name -> (q, k, v, kwargs): each differs from the base call in one fact."""
    q, k, v = qkv()
    token_major = torch.randn(2, 17, 3, 64).to(torch.bfloat16).transpose(1, 2)
    lens = torch.tensor([17, 5], dtype=torch.int32)
    return {
        "base": (q, k, v, BASE),
        "other-address": (q.clone(), k, v, BASE),
        "other-dtype": (q.half(), k, v, BASE),
        "other-strides": (token_major, k, v, BASE),
        "other-key-count": (q, k[:, :, :9], v[:, :, :9], BASE),
        "other-value-shape": (q, k, v[:, :, :9], BASE),
        "other-scale": (q, k, v, {**BASE, "scale": 0.1}),
        "other-kernel": (q, k, v, {**BASE, "kernel": "wgmma"}),
        "other-out-dtype": (q, k, v, {**BASE, "out_dtype": torch.bfloat16}),
        "with-key-lens": (q, k, v, {**BASE, "key_lens": lens}),
        "other-key-lens": (q, k, v, {**BASE, "key_lens": lens.clone()}),
    }


def test_every_fact_changes_the_key() -> None:
    calls = variants()
    keys = {name: call_key(q, k, v, **kwargs) for name, (q, k, v, kwargs) in calls.items()}
    assert len(set(keys.values())) == len(keys), "two different calls share a key"
    q, k, v, kwargs = calls["base"]
    assert call_key(q, k, v, **kwargs) == keys["base"], "the same call must give the same key"


def test_cpu_calls_get_no_fast_path() -> None:
    q, k, v = qkv()
    assert memo_key(q, k, v, None, "auto", None, False, None) is None
