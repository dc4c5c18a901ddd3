"""Small launches of every kernel variant, for compute-sanitizer and ncu.

    compute-sanitizer --tool memcheck  python benchmarks/sanitizer_cases.py
    compute-sanitizer --tool racecheck python benchmarks/sanitizer_cases.py
    ncu --clock-control none -k regex:joint_attention python benchmarks/sanitizer_cases.py --shape 1x24x4608x128

Shapes are odd on purpose (partial query blocks and key tiles). Exits non-zero
if any result is off by more than 1e-5 from float64.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gpu_reference import attention_float64, random_qkv

from pictor_diffusers import attention

CASES = [(1, 2, 77, 128), (2, 1, 45, 64), (1, 2, 130, 96), (1, 1, 70, 200), (1, 1, 33, 384), (1, 1, 1, 32)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="one BxHxNxD shape instead of the odd-shape set")
    args = parser.parse_args()
    cases = [tuple(int(x) for x in args.shape.split("x"))] if args.shape else CASES
    worst = 0.0
    for shape in cases:
        q, k, v = random_qkv(*shape, seed=sum(shape))
        ref = attention_float64(q, k, v)
        for kernel in ("auto", "f32"):
            err = (attention(q, k, v, kernel=kernel).double() - ref).abs().max().item()
            print(f"{shape} kernel={kernel}: max_abs {err:.2e}")
            worst = max(worst, err)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
