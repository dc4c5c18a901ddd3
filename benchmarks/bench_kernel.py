"""Kernel-level benchmark: pictor's kernels against torch SDPA backends.

Per row: median ms of CUDA-event-timed runs after a warm-up, TFLOP/s counted as
4·B·H·N²·D / t, and max-abs / relative-L2 error against float64 SDPA on the
inputs that backend sees (f32 draws for fp32 rows, the same draws rounded to
bf16/fp16 for 16-bit rows). Each backend's result is checked before it is timed.
Rows whose estimated time per call (from a rough TFLOP/s table) exceeds
--max-call-ms, or whose memory would exceed the free GPU memory, are skipped;
the reason is printed in the table only. --plan prints the plan and its
estimated wall time without touching a GPU.

    python benchmarks/bench_kernel.py --shapes 1x24x4608x128 --json benchmarks/results/h200.json
    python benchmarks/bench_kernel.py --plan
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import attention
from pictor_diffusers.testing.references import attention_float64, attention_flops, random_qkv
from pictor_diffusers.testing.timing import median_ms

SDPA_BACKENDS = {
    "sdpa_math": SDPBackend.MATH,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
}
# (backend, dtype) rows run per shape; flash and cuDNN have no fp32 kernels.
DEFAULT_ROWS = [
    ("pictor_fp16x3", "fp32"),
    ("pictor_tf32x3", "fp32"),
    ("pictor_f32", "fp32"),
    ("sdpa_math", "fp32"),
    ("sdpa_efficient", "fp32"),
    ("pictor_wgmma", "bf16"),
    ("pictor_fp8", "bf16"),
    ("pictor_mma16", "bf16"),
    ("sdpa_flash", "bf16"),
    ("sdpa_cudnn", "bf16"),
    ("sdpa_efficient", "bf16"),
    ("sdpa_math", "bf16"),
    ("pictor_wgmma", "fp16"),
    ("sdpa_flash", "fp16"),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# FLUX.2: B 1 and 2; 24 (klein-4B), 32 (klein-9B), 48 (dev) heads; 512² / 1024² / 2048² images.
DEFAULT_SHAPES = ",".join(
    f"{batch}x{heads}x{seq}x128" for seq in (1536, 4608, 16896) for heads in (24, 32, 48) for batch in (1, 2)
)
# Conservative H200 throughput per backend (TFLOP/s), only to plan skips and repetitions.
EST_TFLOPS = {
    "pictor_f32": 4.5,
    "pictor_fp16x3": 120.0,
    "pictor_tf32x3": 40.0,
    "sdpa_math": 15.0,
    "sdpa_efficient": 40.0,
    "reference_f64": 25.0,
}
EST_TFLOPS_16BIT = 150.0
ROW_BUDGET_MS = 3000.0


def estimate_ms(backend: str, shape: tuple[int, ...]) -> float:
    return attention_flops(*shape) / EST_TFLOPS.get(backend, EST_TFLOPS_16BIT) / 1e9


def estimate_bytes(backend: str, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Peak extra memory: the math backend holds ~3 score matrices, the others O(N·D) buffers."""
    batch, heads, seq, head_dim = shape
    element = torch.tensor([], dtype=dtype).element_size()
    io = 8 * batch * heads * seq * head_dim * element
    return io + (3 * batch * heads * seq * seq * element if backend == "sdpa_math" else 0)


def skip_reason(backend: str, dtype: torch.dtype, shape: tuple, max_call_ms: float, free_bytes: int) -> str | None:
    est = estimate_ms(backend, shape)
    if est > max_call_ms:
        return f"~{est / 1000:.1f} s per call estimated (> {max_call_ms / 1000:.1f} s)"
    need = estimate_bytes(backend, dtype, shape)
    if need > 0.6 * free_bytes:
        return f"~{need / 2**30:.0f} GiB needed, {free_bytes / 2**30:.0f} GiB free"
    return None


def repetitions(backend: str, shape: tuple, reps: int) -> tuple[int, int]:
    """(warm-up calls, timed calls): fewer of both for slow rows, so each row stays near ROW_BUDGET_MS."""
    est = estimate_ms(backend, shape)
    timed = max(3, min(reps, int(ROW_BUDGET_MS / max(est, 1e-3))))
    return (0 if est > 200.0 else 3), timed


def _runner(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
    """A call of `backend` on q, k, v (already in the row's dtype), returning token-major output."""
    if backend.startswith("pictor_"):
        kernel = backend.removeprefix("pictor_")
        return lambda: attention(q, k, v, kernel=kernel)

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPA_BACKENDS[backend]):
            out = F.scaled_dot_product_attention(q, k, v)
        batch, heads, seq, head_dim = out.shape
        return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)

    return run


def reference(shape: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 SDPA in head chunks of at most ~4 GB of scores."""
    batch, _, seq, _ = shape
    heads_per_chunk = max(1, int(4e9 // (3 * batch * seq * seq * 8)))
    return attention_float64(q, k, v, heads_per_chunk=heads_per_chunk)


def bench_shape(shape: tuple[int, int, int, int], rows: list[tuple[str, str]], reps: int, max_call_ms: float) -> list:
    q32, k32, v32 = random_qkv(*shape, seed=sum(shape))
    inputs: dict[str, tuple[torch.Tensor, ...]] = {}
    refs: dict[str, torch.Tensor] = {}
    records = []
    for backend, dtype_name in rows:
        dtype = DTYPES[dtype_name]
        reason = skip_reason(backend, dtype, shape, max_call_ms, torch.cuda.mem_get_info()[0])
        if reason is not None:
            print_skip(backend, dtype_name, shape, reason)
            continue
        if dtype_name not in inputs:
            inputs[dtype_name] = tuple(t.to(dtype) for t in (q32, k32, v32))
            refs[dtype_name] = reference(shape, *inputs[dtype_name])
        ref = refs[dtype_name]
        fn = _runner(backend, *inputs[dtype_name])
        try:
            out = fn().double()
        except (RuntimeError, ValueError) as error:
            print_skip(backend, dtype_name, shape, str(error).splitlines()[0])
            continue
        err = out - ref
        record = {
            "suite": "kernel",
            "backend": backend,
            "dtype": dtype_name,
            **dict(zip("BHND", shape, strict=True)),
            "max_abs": err.abs().max().item(),
            "rel_l2": (err.norm() / ref.norm()).item(),
            "finite": bool(torch.isfinite(out).all()),
        }
        del out, err
        warmup, timed = repetitions(backend, shape, reps)
        record["ms"] = median_ms(fn, warmup=warmup, timed=timed)
        record["tflops"] = attention_flops(*shape) / record["ms"] / 1e9
        records.append(record)
        print_row(record)
    torch.cuda.empty_cache()
    return records


def print_row(r: dict) -> None:
    print(
        f"{r['backend']:>15} {r['dtype']:>4} B{r['B']} H{r['H']:>2} N{r['N']:>5} D{r['D']} "
        f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s max_abs {r['max_abs']:.2e} rel_l2 {r['rel_l2']:.2e}",
        flush=True,
    )


def print_skip(backend: str, dtype_name: str, shape: tuple, reason: str) -> None:
    batch, heads, seq, head_dim = shape
    print(f"{backend:>15} {dtype_name:>4} B{batch} H{heads:>2} N{seq:>5} D{head_dim} skipped: {reason}", flush=True)


def plan(shapes: list[tuple], rows: list[tuple[str, str]], reps: int, max_call_ms: float, free_gib: float) -> None:
    """Print which rows would run and the estimated wall time, without a GPU."""
    total_ms = 0.0
    for shape in shapes:
        dtypes = set()
        for backend, dtype_name in rows:
            reason = skip_reason(backend, DTYPES[dtype_name], shape, max_call_ms, int(free_gib * 2**30))
            if reason is not None:
                print_skip(backend, dtype_name, shape, reason)
                continue
            dtypes.add(dtype_name)
            warmup, timed = repetitions(backend, shape, reps)
            row_ms = estimate_ms(backend, shape) * (1 + warmup + timed)
            total_ms += row_ms
            print(f"{backend:>15} {dtype_name:>4} {shape} {1 + warmup + timed:3d} calls ~{row_ms / 1000:6.2f} s")
        total_ms += len(dtypes) * estimate_ms("reference_f64", shape)
    print(f"estimated total: {total_ms / 1000:.0f} s (+ compile and start-up)")


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


def parse_rows(text: str | None) -> list[tuple[str, str]]:
    if not text:
        return DEFAULT_ROWS
    rows = [tuple(item.split(":")) for item in text.split(",")]
    bad = [row for row in rows if len(row) != 2 or row[1] not in DTYPES]
    if bad:
        raise SystemExit(f"--rows takes backend:dtype items with dtype in {list(DTYPES)}, got {bad}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BxHxNxD list")
    parser.add_argument("--rows", help="backend:dtype list (default: all rows), e.g. pictor_wgmma:bf16,sdpa_cudnn:bf16")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-call-ms", type=float, default=2000.0, help="skip rows estimated slower per call")
    parser.add_argument("--json", type=Path, help="write records here")
    parser.add_argument("--plan", action="store_true", help="print the plan and estimated time; run nothing")
    parser.add_argument("--plan-free-gib", type=float, default=139.0, help="GPU memory --plan assumes free")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = parse_rows(args.rows)
    if args.plan:
        plan(shapes, rows, args.reps, args.max_call_ms, args.plan_free_gib)
        return
    records = [r for shape in shapes for r in bench_shape(shape, rows, args.reps, args.max_call_ms)]
    env = environment()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**r, **env} for r in records], indent=1))


if __name__ == "__main__":
    main()
