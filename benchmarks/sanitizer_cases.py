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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flux2_models import build_transformer, transformer_inputs
from gpu_reference import attention_float64, random_qkv

from pictor_diffusers import PictorAttn, attention

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
    finite = args.shape is not None or run_prologue_cases()
    return 0 if worst <= 1e-5 and finite else 1


@torch.no_grad()
def run_prologue_cases() -> bool:
    """Tiny FLUX.2 forwards through PictorAttn: the fused prologue in f32/bf16, fused and not."""
    finite = True
    for dtype in (torch.float32, torch.bfloat16):
        model = build_transformer(device="cuda", dtype=dtype)
        model.set_attn_processor(PictorAttn())
        inputs = transformer_inputs(model, batch=2, latent_hw=(5, 7), text_len=9)
        finite &= bool(torch.isfinite(model(**inputs)[0]).all())
        model.fuse_qkv_projections()
        finite &= bool(torch.isfinite(model(**inputs)[0]).all())
        print(f"tiny FLUX.2 {dtype}: finite={finite}")
    return finite


if __name__ == "__main__":
    raise SystemExit(main())
