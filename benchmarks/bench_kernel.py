"""Kernel-level benchmark: pictor's f32 kernel against torch SDPA backends.

Per row: median ms of CUDA-event-timed runs after a warm-up, TFLOP/s counted as
4·B·H·N²·D / t, and max-abs / relative-L2 error against float64 SDPA on the
same inputs. Each backend's result is checked before it is timed.

    python benchmarks/bench_kernel.py --shapes 1x24x4608x128 --json benchmarks/results/h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_reference import attention_float64, attention_flops, random_qkv

from pictor_diffusers import attention

SDPA_BACKENDS = {
    "sdpa_math": SDPBackend.MATH,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
# (backend, dtype) rows run per shape; flash and cuDNN have no fp32 kernels.
DEFAULT_ROWS = [
    ("pictor_tf32x3", "fp32"),
    ("pictor_f32", "fp32"),
    ("sdpa_math", "fp32"),
    ("sdpa_efficient", "fp32"),
    ("sdpa_flash", "bf16"),
    ("sdpa_cudnn", "bf16"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _runner(backend: str, dtype: torch.dtype, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
    if backend.startswith("pictor_"):
        kernel = backend.removeprefix("pictor_")
        return lambda: attention(q, k, v, kernel=kernel)
    q, k, v = (t.to(dtype) for t in (q, k, v))

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            out = F.scaled_dot_product_attention(q, k, v)
        batch, heads, seq, head_dim = out.shape
        return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)

    return run


def time_ms(fn: Callable, warmup: int, reps: int) -> float:
    """Median CUDA-event time of `fn` in ms, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bench_shape(shape: tuple[int, int, int, int], rows: list[tuple[str, str]], reps: int) -> list[dict]:
    q, k, v = random_qkv(*shape, seed=sum(shape))
    ref = attention_float64(q, k, v)
    records = []
    for backend, dtype_name in rows:
        fn = _runner(backend, DTYPES[dtype_name], q, k, v)
        try:
            out = fn().double()
        except RuntimeError as error:
            print(f"skip {backend} {dtype_name} {shape}: {str(error).splitlines()[0]}")
            continue
        err = out - ref
        ms = time_ms(fn, warmup=3, reps=reps)
        records.append(
            {
                "suite": "kernel",
                "backend": backend,
                "dtype": dtype_name,
                **dict(zip("BHND", shape, strict=True)),
                "ms": ms,
                "tflops": attention_flops(*shape) / ms / 1e9,
                "max_abs": err.abs().max().item(),
                "rel_l2": (err.norm() / ref.norm()).item(),
                "finite": bool(torch.isfinite(out).all()),
            }
        )
        print_row(records[-1])
    return records


def print_row(r: dict) -> None:
    print(
        f"{r['backend']:>15} {r['dtype']:>4} B{r['B']} H{r['H']:>2} N{r['N']:>5} D{r['D']} "
        f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s max_abs {r['max_abs']:.2e} rel_l2 {r['rel_l2']:.2e}",
        flush=True,
    )


def environment() -> dict:
    import subprocess

    import cupy

    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cupy": cupy.__version__,
        "git_commit": commit or "unknown",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1x24x1536x128,1x24x4608x128,1x48x4608x128", help="BxHxNxD list")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, help="write records here")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    records = [r for shape in shapes for r in bench_shape(shape, DEFAULT_ROWS, args.reps)]
    env = environment()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**r, **env} for r in records], indent=1))


if __name__ == "__main__":
    main()
