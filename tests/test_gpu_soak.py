"""Soak: the launch path's caches stay bounded and every result stays exact.

* 5000 calls on one stream;
* 3000 calls, each on a fresh external stream (created outside torch, so
  torch's stream pool cannot recycle its handle), destroyed after use;
* 400 distinct sequence lengths (new tensor maps, new grids).

Host memory (RSS) and device memory must stay flat, the tensor-map cache
within its bound, and each output equal (bitwise) to the same kernel's
output on the default stream, or within the kernel's contract of float64.
"""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from pictor_diffusers import attention
from pictor_diffusers.cuda import tensor_maps
from pictor_diffusers.testing.references import attention_float64, random_qkv

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = (1, 2, 77, 128)
HOST_GROWTH_MB = 8.0


def rss_mb() -> float:
    """Resident set size now, from /proc (ru_maxrss only ever grows)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def settle() -> tuple[float, int]:
    gc.collect()
    torch.cuda.synchronize()
    return rss_mb(), torch.cuda.memory_allocated()


def inputs(dtype: torch.dtype, seq: int = SHAPE[2], seed: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(dtype) for t in random_qkv(SHAPE[0], SHAPE[1], seq, SHAPE[3], seed=seed))


@pytest.mark.parametrize("precision", list(DTYPES))
def test_many_calls_on_one_stream(precision: str) -> None:
    query, key, value = inputs(DTYPES[precision], seed=1)
    expected = attention(query, key, value)
    for _ in range(200):
        attention(query, key, value)
    host, device = settle()
    for _ in range(5000):
        out = attention(query, key, value)
    assert torch.equal(out, expected)
    del out
    host_after, device_after = settle()
    assert host_after - host <= HOST_GROWTH_MB, f"host memory grew {host_after - host:.1f} MB over 5000 calls"
    assert device_after == device, f"device memory grew {device_after - device} bytes"


@pytest.mark.parametrize("precision", list(DTYPES))
def test_a_fresh_external_stream_per_call(precision: str) -> None:
    import cupy

    query, key, value = inputs(DTYPES[precision], seed=2)
    expected = attention(query, key, value)
    for _ in range(100):
        attention(query, key, value)
    host, device = settle()
    mismatches = 0
    for _ in range(3000):
        raw = cupy.cuda.Stream(non_blocking=True)
        stream = torch.cuda.ExternalStream(raw.ptr)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = attention(query, key, value)
        torch.cuda.current_stream().wait_stream(stream)
        mismatches += not torch.equal(out, expected)
        out.record_stream(stream)
        stream.synchronize()
        del out, stream, raw
    assert mismatches == 0, f"{mismatches} of 3000 side-stream results differ"
    host_after, device_after = settle()
    assert host_after - host <= HOST_GROWTH_MB, f"host memory grew {host_after - host:.1f} MB over 3000 streams"
    assert device_after == device, f"device memory grew {device_after - device} bytes"


@pytest.mark.parametrize("precision", list(DTYPES))
def test_four_hundred_sequence_lengths(precision: str) -> None:
    dtype = DTYPES[precision]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for seq in range(1, 41):  # warm the caches past their first growth
        attention(*inputs(dtype, seq))
    host, device = settle()
    worst = 0.0
    for seq in range(41, 441):
        query, key, value = inputs(dtype, seq, seed=seq)
        out = attention(query, key, value)
        worst = max(worst, (out.double() - attention_float64(query, key, value)).abs().max().item())
        del out, query, key, value
    assert worst <= tolerance, f"max-abs {worst:.2e} over 400 lengths"
    assert tensor_maps.cached_maps() <= tensor_maps.CACHE_SIZE
    host_after, device_after = settle()
    assert host_after - host <= HOST_GROWTH_MB, f"host memory grew {host_after - host:.1f} MB over 400 lengths"
    assert device_after == device, f"device memory grew {device_after - device} bytes"
