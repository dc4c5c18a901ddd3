"""A/B kernel timing of two pictor-diffusers checkouts in one run, interleaved.

Two worker processes, one per checkout (each imports its own `pictor_diffusers`
and compiles its own `kernels/`), time the same rows through the public
`attention()`; per row the driver alternates A, B, then B, A, ... so clock
and thermal drift hit both sides alike, in both run orders. Per row: the median over rounds of each
side's CUDA-event median (GPU time, the GPU held ~1 ms before each call), and
the ratio B / A.

    python benchmarks/bench_ab.py --baseline /path/to/old/checkout --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

ROWS = [("tf32x3", "fp32"), ("f32", "fp32"), ("wgmma", "bf16"), ("mma16", "bf16"), ("wgmma", "fp16")]
SHAPES = [(b, h, n, 128) for n in (1536, 4608, 16896) for h in (24, 32, 48) for b in (1, 2)]
GPU_HOLD_CYCLES = 2_000_000
"""~1 ms of GPU spin before each timed call: the events time GPU work, not host launch overhead."""
MAX_F32_SEQ = 4608
"""The scalar reference kernel takes seconds per call beyond this; its rows stop here."""


def serve() -> None:
    """Worker: read `kernel dtype layout B H Nq Nk D warmup timed` lines, answer each with the median ms.
    `layout`: "head-major" (`[B, H, N, D]` tensors) or "token-major" (`[B, N, H, D]` storage seen as
    `[B, H, N, D]`, as diffusers' dispatcher passes q, k, v)."""
    import torch

    from pictor_diffusers import attention  # the checkout's own; nothing else of it is assumed

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for line in sys.stdin:
        kernel, dtype, layout, *numbers = line.split()
        batch, heads, seq_q, seq_k, head_dim, warmup, timed = (int(x) for x in numbers)
        generator = torch.Generator(device="cuda").manual_seed(seq_q + seq_k + heads)
        shapes = [(batch, seq_q, heads, head_dim)] + [(batch, seq_k, heads, head_dim)] * 2
        drawn = [torch.randn(shape, generator=generator, device="cuda").to(dtypes[dtype]) for shape in shapes]
        q, k, v = (t.transpose(1, 2) if layout == "token-major" else t.transpose(1, 2).contiguous() for t in drawn)
        del drawn
        for _ in range(warmup):
            attention(q, k, v, kernel=kernel)
        times = []
        for _ in range(timed):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(GPU_HOLD_CYCLES)
            start.record()
            attention(q, k, v, kernel=kernel)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del q, k, v
        torch.cuda.empty_cache()
        print(json.dumps({"ms": median(times)}), flush=True)


class Worker:
    """One checkout's serving process."""

    def __init__(self, checkout: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(checkout), os.environ.get("PYTHONPATH"))))}
        command = [sys.executable, str(Path(__file__).resolve()), "--serve"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def time(self, request: str) -> float:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"worker died on {request!r}")
        return json.loads(answer)["ms"]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


def repetitions(kernel: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(warm-up, timed) calls, fewer for the slow f32-path rows."""
    batch, heads, seq_q, seq_k, _ = shape
    work = batch * heads * seq_q * seq_k / (2 * 48 * 16896**2)
    if kernel in ("tf32x3", "f32") and work > 0.05:
        return 1, 3
    return 3, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", type=Path, help="checkout A (its folder holds pictor_diffusers/ and kernels/)")
    parser.add_argument("--candidate", type=Path, default=Path(__file__).resolve().parents[1], help="checkout B")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rows", help="comma list of kernel:dtype (default: every pictor row)")
    parser.add_argument(
        "--shapes",
        help="comma list of BxHxNxD or, for cross-attention, BxHxNqxNkxD (default: FLUX.2's B 1-2, H "
        "24-48, N 1536-16896)",
    )
    parser.add_argument(
        "--layout",
        choices=("head-major", "token-major"),
        default="head-major",
        help="q, k, v as [B, H, N, D] tensors, or [B, N, H, D] storage seen as [B, H, N, D]",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    workers = {"A": Worker(args.baseline.resolve()), "B": Worker(args.candidate.resolve())}
    records = []
    rows = [tuple(row.split(":")) for row in args.rows.split(",")] if args.rows else ROWS
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    for shape in (s if len(s) == 5 else (*s[:3], *s[2:]) for s in shapes):
        for kernel, dtype in rows:
            if kernel == "f32" and max(shape[2:4]) > MAX_F32_SEQ:
                continue
            request = " ".join(map(str, (kernel, dtype, args.layout, *shape, *repetitions(kernel, shape))))
            times: dict[str, list[float]] = {"A": [], "B": []}
            for round_ in range(args.rounds):
                for side in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                    times[side].append(workers[side].time(request))
            a, b = median(times["A"]), median(times["B"])
            flops = 4 * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            record = {
                "suite": "ab",
                "kernel": kernel,
                "dtype": dtype,
                "layout": args.layout,
                **dict(zip(("B", "H", "N", "Nk", "D"), shape, strict=True)),
            }
            record |= {"ms_a": a, "ms_b": b, "ratio_b_over_a": b / a, "tflops_a": flops / a / 1e9}
            record |= {"tflops_b": flops / b / 1e9}
            records.append(record)
            print(f"{kernel:>7} {dtype} B{shape[0]} H{shape[1]:>2} N{shape[2]:>5} Nk{shape[3]:>5} D{shape[4]}: "
                  f"A {a:9.3f} ms ({record['tflops_a']:5.1f} TF)  B {b:9.3f} ms ({record['tflops_b']:5.1f} TF)  "
                  f"B/A {b / a:.3f}", flush=True)  # fmt: skip
    for worker in workers.values():
        worker.close()
    worst = max(records, key=lambda r: r["ratio_b_over_a"])
    print(f"worst B/A {worst['ratio_b_over_a']:.3f}: {worst['kernel']} {worst['dtype']} "
          f"B{worst['B']} H{worst['H']} N{worst['N']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
