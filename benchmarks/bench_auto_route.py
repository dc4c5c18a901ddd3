"""Where 16-bit "auto" sends a call, timed against what it passed over, in one process on one GPU.

For each shape: torch's SDPA (its default backend choice), alone and followed by the token-major
`[B, N, H*D]` layout pictor returns (`sdpa_token_major`: what a caller of SDPA pays to get pictor's
output), pictor's `mma16` and, on Hopper, `wgmma` (head_dim 64 and 128); then `attention()` with
kernel="auto", which must be at least as fast as the best of them it may pick. Fresh N(0, 1) bf16
inputs, outputs written fresh each call; median of 20 CUDA-event timings after a warm-up;
FLOPs as 4 B H N^2 D. Usage: python benchmarks/bench_auto_route.py [--json F]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from pictor_diffusers import attention
from pictor_diffusers.cuda.plan import cannot_run
from pictor_diffusers.testing.timing import median_ms

SHAPES = [
    (1, 24, 4608, 64), (2, 24, 4429, 64), (1, 32, 6144, 64), (1, 24, 16384, 64),
    (1, 24, 4608, 128), (2, 24, 8192, 128), (1, 24, 16896, 128),
]  # fmt: skip


def row(shape: tuple[int, int, int, int]) -> dict[str, object]:
    batch, heads, seq, head_dim = shape
    generator = torch.Generator(device="cuda").manual_seed(seq + head_dim)
    q, k, v = (torch.randn(shape, device="cuda", generator=generator).bfloat16() for _ in range(3))
    runs = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "sdpa_token_major": lambda: F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2),
        "auto": lambda: attention(q, k, v),
    }
    for kernel in ("wgmma", "mma16"):
        if cannot_run(kernel, q, k, v) is None:
            runs[kernel] = lambda kernel=kernel: attention(q, k, v, kernel=kernel)
    flops = 4 * batch * heads * seq * seq * head_dim
    record: dict[str, object] = {"shape": list(shape), "gpu": torch.cuda.get_device_name()}
    for name, run in runs.items():
        ms = median_ms(run, warmup=5, timed=20)
        record[f"{name}_ms"], record[f"{name}_tflops"] = round(ms, 4), round(flops / ms / 1e9, 1)
    print(json.dumps(record))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    records = [row(shape) for shape in SHAPES]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)


if __name__ == "__main__":
    main()
