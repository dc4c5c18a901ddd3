"""What PictorAttn costs besides the kernels: compile, start-up, host overhead per call.

* cold: first `attention()` call in a new process with empty CuPy and pictor
  kernel caches (NVRTC compile + module load), for the fp32 path (3xTF32 kernel)
  and the bf16 path (the sm_90a wgmma cubin on Hopper);
* warm: the same in a new process whose cache holds the compiled kernels;
* per call: host time of `attention()` at a small N, launched back to back
  without synchronising, against the kernel's own CUDA-event time (graph replay);
* per prologue call: host time of `pack_head_major` (the fused QK-norm / RoPE /
  head-major launch PictorAttn makes before each attention) on FLUX.2-like
  projections, text and image segments, with RoPE;
* per parity-path attention on Hopper: the prologue and the attention together, on the fused split route
  and on the unfused one (prologue to f32, then `attention()` with its split prepass).

    python benchmarks/bench_overheads.py --json benchmarks/results/h200_overheads.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FIRST_CALL = """
import os, sys, time, torch
from pictor_diffusers import attention
q = torch.randn(1, 2, 64, 128, device="cuda").to(getattr(torch, sys.argv[1]))
torch.cuda.synchronize()
start = time.perf_counter()
attention(q, q, q)
torch.cuda.synchronize()
print(time.perf_counter() - start, len(os.listdir(os.environ["PICTOR_CACHE_DIR"])))
"""


def first_call_seconds(cache_dir: str, dtype: torch.dtype) -> tuple[float, int]:
    """(wall time of the first attention() call in a fresh process using `cache_dir` for both caches,
    files in the cache after it: a cold call must have compiled and stored its kernel)."""
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir, "PICTOR_CACHE_DIR": cache_dir}
    command = [sys.executable, "-c", FIRST_CALL, str(dtype).removeprefix("torch.")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    seconds, files = result.stdout.strip().splitlines()[-1].split()
    return float(seconds), int(files)


def per_call_overhead(dtype: torch.dtype, kernel: str = "auto", calls: int = 2000) -> tuple[float, float]:
    """(host µs per call launched back to back, GPU µs per call) at B=1, H=2, N=64, D=128."""
    from pictor_diffusers import attention

    q = torch.randn(1, 2, 64, 128, device="cuda").to(dtype)
    host = host_us_per_call(lambda: attention(q, q, q, kernel=kernel), calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention(q, q, q, kernel=kernel)
    graph.replay()
    torch.cuda.synchronize()
    replay_start, replay_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay_start.record()
    for _ in range(100):
        graph.replay()
    replay_end.record()
    replay_end.synchronize()
    return host, replay_start.elapsed_time(replay_end) / 100 * 1e3


GPU_HOLD_CYCLES = 100_000_000
"""~50 ms of GPU spin queued before each batch: the batch's launches queue behind it, so the host
loop is timed alone, never waiting on a full launch queue (tiny kernels with shared-memory
reconfigurations between them can take longer on the GPU than their launches on the host)."""


def host_us_per_call(run: object, calls: int = 2000, batches: int = 20) -> float:
    """Host µs per call of `run()`: the median over `batches` batches of back-to-back calls issued
    while the GPU is held busy (see GPU_HOLD_CYCLES), after a warm-up."""
    for _ in range(20):
        run()
    torch.cuda.synchronize()
    per_batch = calls // batches
    times = []
    for _ in range(batches):
        torch.cuda._sleep(GPU_HOLD_CYCLES)
        start = time.perf_counter()
        for _ in range(per_batch):
            run()
        times.append((time.perf_counter() - start) / per_batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def per_call_prologue_overhead(precision_dtype: torch.dtype, norm_dtype: torch.dtype = torch.float32) -> float:
    """Host µs per `pack_head_major` call: bf16 projections of 8 text + 56 image tokens, 2 heads of 128;
    QK-norm weights in `norm_dtype` (a bf16 model's are bf16, and the kernel reads float32 weights)."""
    from pictor_diffusers.ops.prologue import Segment, pack_head_major

    heads, head_dim = 2, 128
    norms = [torch.nn.RMSNorm(head_dim, eps=1e-6).to("cuda", norm_dtype) for _ in range(4)]
    fused = [torch.randn(1, n, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16) for n in (8, 56)]
    segments = [Segment(*x.chunk(3, dim=-1), *norms[2 * i : 2 * i + 2]) for i, x in enumerate(fused)]
    rope = tuple(torch.randn(64, head_dim, device="cuda") for _ in range(2))
    with torch.no_grad():
        return host_us_per_call(lambda: pack_head_major(segments, head_dim, rope, precision_dtype))


def per_call_parity_route_overhead(fused: bool) -> float:
    """Host µs per parity-path attention of `PictorAttn` on the prologue case's projections (bf16, f32 norm
    weights): the fused split route (`split_attention`), or the unfused one (`pack_head_major` to f32, then
    `attention()`, which runs the split prepass)."""
    from pictor_diffusers import attention
    from pictor_diffusers.ops.prologue import Segment, pack_head_major
    from pictor_diffusers.ops.split_route import split_attention

    heads, head_dim = 2, 128
    norms = [torch.nn.RMSNorm(head_dim, eps=1e-6).to("cuda") for _ in range(4)]
    fused_qkv = [torch.randn(1, n, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16) for n in (8, 56)]
    segments = [Segment(*x.chunk(3, dim=-1), *norms[2 * i : 2 * i + 2]) for i, x in enumerate(fused_qkv)]
    rope = tuple(torch.randn(64, head_dim, device="cuda") for _ in range(2))

    def unfused() -> torch.Tensor:
        return attention(*pack_head_major(segments, head_dim, rope, torch.float32), out_dtype=torch.bfloat16)

    def split() -> torch.Tensor:
        return split_attention(segments, head_dim, rope, "auto", torch.bfloat16)

    with torch.no_grad():
        return host_us_per_call(split if fused else unfused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    records = []
    for name, dtype in DTYPES.items():
        with tempfile.TemporaryDirectory() as cache:
            cold, cached_files = first_call_seconds(cache, dtype)
            warm, _ = first_call_seconds(cache, dtype)
        host_us, kernel_us = per_call_overhead(dtype)
        prologue_us = per_call_prologue_overhead(dtype)
        if dtype == torch.float32:
            others = {f"host_us_per_call_{k}": per_call_overhead(dtype, k)[0] for k in ("tf32x3", "fp16x3")}
            if torch.cuda.get_device_capability() == (9, 0):
                others["parity_route_host_us_unfused"] = per_call_parity_route_overhead(fused=False)
                others["parity_route_host_us_fused"] = per_call_parity_route_overhead(fused=True)
        else:
            others = {"prologue_host_us_per_call_bf16_norms": per_call_prologue_overhead(dtype, torch.bfloat16)}
        records.append(
            {
                "suite": "overheads",
                "dtype": name,
                "gpu": torch.cuda.get_device_name(),
                "first_call_cold_cache_s": cold,
                "first_call_warm_cache_s": warm,
                "cached_files_after_cold_call": cached_files,
                "host_us_per_call": host_us,
                "kernel_us_per_call_graph_replay": kernel_us,
                "prologue_host_us_per_call": prologue_us,
                **others,
            }
        )
    print(json.dumps(records, indent=1))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
