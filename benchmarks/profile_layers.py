"""The CUDA kernels behind a `bench_layers.py` row: native against pictor_bf16, by torch.profiler.

A layer's ratio moves by a few percent between machine starts; the kernel table shows which kernels differ
(cuDNN's or flash's attention against `joint_attention_wgmma`, and everything around them).

    python benchmarks/profile_layers.py wan-cross,ltx-block > benchmarks/results/h100_profile_wan_cross_ltx.txt
"""

from __future__ import annotations

import argparse

import torch
from layer_cases import backend_call, layers

WARMUP, PROFILED = 3, 5


def kernel_table(call: object) -> str:
    """torch.profiler's CUDA kernel table over `PROFILED` calls of `call`, after `WARMUP` calls."""
    with torch.no_grad():
        for _ in range(WARMUP):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(PROFILED):
                call()
            torch.cuda.synchronize()
    return profile.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", help="comma-separated bench_layers rows, e.g. wan-cross,ltx-block")
    args = parser.parse_args()
    builders = layers("cuda")
    for name in args.rows.split(","):
        layer = builders[name]()
        for label, call in (("native", layer.native), ("pictor_bf16", backend_call(layer, "pictor_bf16"))):
            print(f"==== {name} {label} ({PROFILED} calls)")
            print(kernel_table(call))
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
