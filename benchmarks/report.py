"""Render benchmark JSON into Markdown tables and a TFLOP/s-vs-N plot.

    python benchmarks/report.py benchmarks/results/h200_kernel.json benchmarks/results/h200_model.json \
        --plot benchmarks/results/h200_tflops.png

Needs matplotlib only for --plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def kernel_table(records: list[dict]) -> str:
    rows = ["| backend | dtype | B | H | N | D | ms | TFLOP/s | max-abs | rel-L2 |", "|---" * 10 + "|"]
    for r in records:
        rows.append(
            f"| {r['backend']} | {r['dtype']} | {r['B']} | {r['H']} | {r['N']} | {r['D']} | {r['ms']:.3f} "
            f"| {r['tflops']:.1f} | {r['max_abs']:.2e} | {r['rel_l2']:.2e} |"
        )
    return "\n".join(rows)


def model_table(records: list[dict]) -> str:
    rows = [
        "| model | image | tokens | backend | attention dtype | ms / step | x stock | attention TFLOP/s | peak GiB "
        "| max-abs vs stock | rel-L2 vs stock |",
        "|---" * 11 + "|",
    ]
    stock = {(r["model"], r["image"]): r["ms"] for r in records if r["backend"] == "stock"}
    for r in records:
        ratio = r["ms"] / stock[(r["model"], r["image"])]
        rel = r.get("rel_l2", r.get("rel_l2_vs_stock"))
        tflops = f"{r['tflops']:.1f}" if r.get("tflops") is not None else "-"
        max_abs = f"{r['max_abs']:.2e}" if r.get("max_abs") is not None else "-"
        rows.append(
            f"| {r['model']} | {r['image']}² | {r['N']} | {r['backend']} | {r['dtype']} | {r['ms']:.1f} | {ratio:.2f} "
            f"| {tflops} | {r['peak_gib']:.1f} | {max_abs} | {rel:.2e} |"
        )
    return "\n".join(rows)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r["B"] == 1 and r["H"] == 24:
            series.setdefault(f"{r['backend']} ({r['dtype']})", []).append((r["N"], r["tflops"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([n for n, _ in points], [t for _, t in points], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N (B=1, H=24, D=128)")
    ax.set_ylabel("TFLOP/s (4·B·H·N²·D / t)")
    ax.set_title(f"Attention forward on {records[0].get('gpu', 'GPU')}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="JSON files from bench_kernel.py / bench_model.py")
    parser.add_argument("--plot", type=Path, help="write the kernel TFLOP/s plot here (PNG)")
    args = parser.parse_args()
    records = [r for path in args.results for r in json.loads(path.read_text())]
    kernel = [r for r in records if r["suite"] == "kernel"]
    model = [r for r in records if r["suite"] == "model"]
    if kernel:
        print(kernel_table(kernel), end="\n\n")
    if model:
        print(model_table(model))
    if args.plot and kernel:
        plot(kernel, args.plot)


if __name__ == "__main__":
    main()
