"""Bit-exactness of a kernel change: save one checkout's outputs, then compare two saved runs.

    PYTHONPATH=.ab/base python benchmarks/exact_ab.py save /tmp/a.pt --kernel fp16x3
    python benchmarks/exact_ab.py save /tmp/b.pt --kernel fp16x3
    python benchmarks/exact_ab.py compare /tmp/a.pt /tmp/b.pt

`save` runs `attention()` of whichever `pictor_diffusers` is first on the path on fresh N(0, 3²) float32 q, k,
v `[B, H, N, D]` (seeded per shape, so both runs draw the same; N not a multiple of the tiles included) and
writes the outputs; `compare` prints max |A - B| and whether each output is bit-identical.
"""

from __future__ import annotations

import argparse
import sys

import torch

SHAPES = [(1, 24, 1000, 128), (2, 3, 4608, 128), (1, 2, 333, 128)]


def save(path: str, kernel: str, dtype: torch.dtype) -> None:
    from pictor_diffusers import attention  # the checkout's own

    outputs = []
    for shape in SHAPES:
        generator = torch.Generator(device="cuda").manual_seed(sum(shape))
        q, k, v = (3 * torch.randn(shape, generator=generator, device="cuda") for _ in range(3))
        outputs.append(attention(*(t.to(dtype) for t in (q, k, v)), kernel=kernel).cpu())
    torch.save(outputs, path)


def compare(path_a: str, path_b: str) -> bool:
    """True when every output of B equals A's bit for bit."""
    same = True
    for a, b in zip(torch.load(path_a), torch.load(path_b), strict=True):
        equal = torch.equal(a, b)
        same &= equal
        print(f"{tuple(a.shape)}: max|A-B| {(a.float() - b.float()).abs().max().item():.3e}, bit-identical {equal}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "compare"))
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--kernel", default="fp16x3")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    args = parser.parse_args()
    if args.action == "save":
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        save(args.paths[0], args.kernel, dtype)
    else:
        sys.exit(0 if compare(*args.paths[:2]) else 1)


if __name__ == "__main__":
    main()
