"""CPU accuracy study of the planned 8-bit Hopper attention (`pictor_diffusers.ops.quant_reference`).

Each scheme's error against float64 SDPA on the same float32 inputs, for the three input sets of
`study_inputs` (N(0, 1); K with a 5-sigma per-channel offset; q and k x4; and, beyond the issue's three,
V with a 5-sigma per-channel offset), B 1, H 2, D 128. Targets: cosine >= 0.9995 and relative L1 <= 3 x
the bf16 path's on the same inputs. Prints a markdown table, one row per scheme (~1 minute on 2 CPU cores).

    python benchmarks/quant_study.py [--seq 4608] [--heads 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from pictor_diffusers.ops.quant_reference import INT8_PV_SCHEME, int8_fp8_attention
from pictor_diffusers.testing.quant_study import bf16_path_attention, error_metrics, study_inputs
from pictor_diffusers.testing.references import attention_float64

COS_TARGET, L1_FACTOR = 0.9995, 3.0
INPUT_SETS = ("normal", "k_offset", "peaky", "v_offset")  # the three, and V with a 5-sigma offset
Scheme = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PLANNED = int8_fp8_attention
SCHEMES: dict[str, Scheme] = {
    "bf16 path (current)": bf16_path_attention,
    "**planned**: int8 QK 64/128 blocks, K smoothing, fp8 PV, P x448": PLANNED,
    "planned, no K smoothing": partial(PLANNED, k_smoothing=False),
    "planned, V smoothing": partial(PLANNED, v_smoothing=True),
    "planned, P per row and tile (tile max -> 448)": partial(PLANNED, p_scale="row"),
    "planned, 14-bit PV acc., promoted per 128 keys": partial(PLANNED, pv_accum_bits=14),
    "planned, 14-bit PV acc., never promoted": partial(PLANNED, pv_accum_bits=14, pv_promote=False),
    "planned, V smoothing, 14-bit never promoted": partial(
        PLANNED, v_smoothing=True, pv_accum_bits=14, pv_promote=False
    ),
    "fp8 QK 64/128 blocks (else planned)": partial(PLANNED, qk_format="fp8"),
    "int8 QK 64/128 blocks, bf16 PV": partial(PLANNED, pv_format="bf16"),
    "int8 QK 16/8 blocks, bf16 PV": partial(PLANNED, pv_format="bf16", q_block=16, k_block=8),
    "int8 QK per token, bf16 PV": partial(PLANNED, pv_format="bf16", q_block=1, k_block=1),
    "int8 QK per token, fp8 PV, P per row": partial(PLANNED, p_scale="row", q_block=1, k_block=1),
    "int8 PV: u8 P per row and tile, int8 V about its mid-range, Q per token": partial(PLANNED, **INT8_PV_SCHEME),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4608)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    cells: dict[str, list[str]] = {name: [] for name in SCHEMES}
    for input_set in INPUT_SETS:
        q, k, v = study_inputs(input_set, 1, args.heads, args.seq, 128, seed=args.seed)
        reference = attention_float64(q, k, v)
        bf16_l1 = None
        for name, scheme in SCHEMES.items():
            m = error_metrics(scheme(q, k, v), reference)
            bf16_l1 = m["rel_l1"] if bf16_l1 is None else bf16_l1
            factor = m["rel_l1"] / bf16_l1
            met = "ok" if m["cos"] >= COS_TARGET and factor <= L1_FACTOR else "**MISS**"
            cells[name].append(
                f"{m['cos']:.5f} / {m['rel_l1']:.2e} ({factor:.3g}x) / {m['rel_l2']:.2e} / {m['max_abs']:.1e} {met}"
            )
    print(f"B 1, H {args.heads}, N {args.seq}, D 128, seed {args.seed}, vs float64 SDPA. Cells: cos / rel L1 (x bf16 "
          f"path's) / rel L2 / max abs; ok = cos >= {COS_TARGET} and rel L1 <= {L1_FACTOR:g}x bf16.\n")  # fmt: skip
    print("| scheme | " + " | ".join(INPUT_SETS) + " |")
    print("|---" * (len(INPUT_SETS) + 1) + "|")
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
