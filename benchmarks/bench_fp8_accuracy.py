"""An 8-bit kernel against its torch twin and float64 at FLUX.2's sequence lengths, on the study's input sets.

`--kernel`: "int8" (the default, the "fp8" precision's kernel) or "fp8" (E4M3 P.V).

Per row (input set, heads, tokens; B1 D128, bf16 inputs from `quant_reference.study_inputs`): the kernel's
relative L2 from `kernel_twin` (the same quantisation: a kernel bug shows far above the twin's rounding noise),
the LSE's largest gap from the twin's and from float64, and cosine / relative L1 of kernel and twin against
float64 attention. This is the check that caught the FP8 wgmma's short accumulator summing l, and then O
(on v_offset), over all keys.

    python benchmarks/bench_fp8_accuracy.py --kernel fp8 --json benchmarks/results/h200_fp8_accuracy.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pictor_diffusers import attention
from pictor_diffusers.ops.quant_reference import kernel_twin
from pictor_diffusers.testing.quant_study import error_metrics, study_inputs
from pictor_diffusers.testing.references import rel_l2

CASES = [("normal", 2, 16896), ("peaky", 2, 16896), ("v_offset", 2, 16896), ("k_offset", 2, 4608)] + [
    (kind, 24, 4608) for kind in ("normal", "peaky", "k_offset", "v_offset")
]
"""("v_offset": V's mean makes O a positive sum over all keys; the FP8 wgmma's short adds lose its low bits
unless each tile's sum is promoted to f32.)"""


def accuracy_row(kind: str, heads: int, seq: int, kernel: str) -> dict:
    q, k, v = (t.cuda().bfloat16() for t in study_inputs(kind, 1, heads, seq, 128, seed=seq + heads))
    out, lse = attention(q, k, v, kernel=kernel, return_lse=True)
    twin_out, twin_lse = kernel_twin(q.float(), k.float(), v.float(), 128**-0.5, return_lse=True, kernel=kernel)
    logits = (q.double() @ k.double().transpose(-1, -2)) * 128**-0.5
    exact = (torch.softmax(logits, -1) @ v.double()).transpose(1, 2).reshape(1, seq, heads * 128)
    exact_lse = torch.logsumexp(logits, -1).transpose(1, 2)
    kernel_err, twin_err = error_metrics(out.double(), exact), error_metrics(twin_out.double(), exact)
    return {
        "kernel": kernel,
        "set": kind,
        "shape": [1, heads, seq, 128],
        "vs_twin_rel_l2": rel_l2(out.double(), twin_out.double()),
        "lse_vs_twin": (lse - twin_lse).abs().max().item(),
        "lse_vs_float64": (lse.double() - exact_lse).abs().max().item(),
        **{f"kernel_{name}": value for name, value in kernel_err.items()},
        **{f"twin_{name}": value for name, value in twin_err.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="int8", choices=("int8", "fp8"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for case in CASES:
        row = accuracy_row(*case, args.kernel)
        rows.append(row)
        print(
            f"{row['set']:>8} {row['shape']}: vs twin {row['vs_twin_rel_l2']:.2e}, LSE vs twin {row['lse_vs_twin']:.2e}"
            f" vs float64 {row['lse_vs_float64']:.2e}; float64 cos/rel_l1 kernel {row['kernel_cos']:.5f}/"
            f"{row['kernel_rel_l1']:.3e} twin {row['twin_cos']:.5f}/{row['twin_rel_l1']:.3e}",
            flush=True,
        )
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"suite": "fp8_accuracy", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
