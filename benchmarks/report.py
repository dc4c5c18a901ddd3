"""Render benchmark JSON into Markdown tables, a TFLOP/s-vs-N plot and an end-to-end ratio plot.

    python benchmarks/report.py benchmarks/results/h200_kernel.json benchmarks/results/h200_model.json \
        --plot benchmarks/results/h200_tflops.png --model-plot benchmarks/results/h200_model_ratio.png

Needs matplotlib only for --plot / --model-plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FAMILY_COLOURS = {
    "pictor_wgmma": "#d62728",
    "pictor_mma16": "#ff7f0e",
    "pictor_tf32x3": "#1f77b4",
    "pictor_f32": "#17becf",
    "sdpa_cudnn": "#2ca02c",
    "sdpa_flash": "#9467bd",
    "sdpa_efficient": "#8c564b",
    "sdpa_math": "#7f7f7f",
}
"""One colour per backend family, the same in every panel and both plots."""
MODEL_COLOURS = {
    "pictor_bf16": FAMILY_COLOURS["pictor_wgmma"],
    "pictor_fp32": FAMILY_COLOURS["pictor_tf32x3"],
    "pictor_fp8": "#e377c2",
}
DTYPE_MARKERS = {"fp32": "o", "bf16": "s", "fp16": "^"}
PANELS = (("fp32: parity path", ("fp32",)), ("bf16 / fp16: fast path", ("bf16", "fp16")))


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


def stack_table(records: list[dict]) -> str:
    """bench_stack.py's records: one row per (model, image, linears, backend), ratios to stock with the same linears."""
    rows = [
        "| model | image | linears | backend | ms / step | x stock | rel-L2 vs stock | compile s |",
        "|---" * 8 + "|",
    ]
    for r in records:
        rows.append(
            f"| {r['model']} | {r['image']}² | {r['linears']} | {r['backend']} | {r['ms']:.1f} | {r['x_stock']:.3f} "
            f"| {r['rel_l2_vs_stock']:.2e} | {r['compile_s']:.0f} |"
        )
    return "\n".join(rows)


def stack_as_model(records: list[dict]) -> list[dict]:
    """Stack records as `model_plot` groups them: one group per (model and linears, image)."""
    return [{**r, "model": f"{r['model']}\n{r['linears']} linears", "processor": r["backend"]} for r in records]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series_style(backend: str, dtype: str) -> dict[str, Any]:
    """Line style of one kernel series: colour by backend family, pictor solid, SDPA dashed, marker by dtype."""
    return {
        "color": FAMILY_COLOURS.get(backend, "black"),
        "linestyle": "-" if backend.startswith("pictor") else "--",
        "marker": DTYPE_MARKERS.get(dtype, "x"),
        "linewidth": 2.2 if backend.startswith("pictor") else 1.6,
    }


def plot(records: list[dict], path: Path) -> None:
    """TFLOP/s against N at B=1, H=24: one panel per precision path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 4.8), sharey=True)
    for ax, (title, dtypes) in zip(axes, PANELS, strict=True):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in records:
            if r["B"] == 1 and r["H"] == 24 and r["dtype"] in dtypes:
                series.setdefault((r["backend"], r["dtype"]), []).append((r["N"], r["tflops"]))
        order = sorted(series, key=lambda key: (not key[0].startswith("pictor"), key))
        for backend, dtype in order:
            points = sorted(series[(backend, dtype)])
            ax.plot(
                [n for n, _ in points],
                [t for _, t in points],
                label=f"{backend} ({dtype})",
                **series_style(backend, dtype),
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (B=1, H=24, D=128)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("TFLOP/s (4·B·H·N²·D / t)")
    fig.suptitle(f"Attention forward on {records[0].get('gpu', 'GPU')}: pictor solid, SDPA dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_ratios(records: list[dict]) -> tuple[list[str], dict[str, list[float | None]]]:
    """Group labels ("klein-4B\\n1024²") and, per non-stock backend, its time / stock's time in each group."""
    stock = {(r["model"], r["image"]): r["ms"] for r in records if r["backend"] == "stock"}
    groups = list(dict.fromkeys((r["model"], r["image"]) for r in records if (r["model"], r["image"]) in stock))
    found = {(r["backend"], r["model"], r["image"]): r["ms"] for r in records if r["backend"] != "stock"}
    backends = sorted({backend for backend, _, _ in found}, key=lambda name: ("fp32" in name, name))
    ratios = {
        backend: [found[(backend, *group)] / stock[group] if (backend, *group) in found else None for group in groups]
        for backend in backends
    }
    return [f"{model}\n{image}²" for model, image in groups], ratios


def model_plot(records: list[dict], path: Path, title: str | None = None) -> None:
    """Time of one transformer forward against stock's, per model and image size: bars from 1.0 (= stock)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    plt = _pyplot()
    labels, ratios = model_ratios(records)
    names = {r["backend"]: r.get("processor", r["backend"]) for r in records}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(labels)), 5.0))
    width = 0.8 / max(len(ratios), 1)
    shown_values = [v for values in ratios.values() for v in values if v is not None]
    for i, (backend, values) in enumerate(ratios.items()):
        xs = [g + (i - (len(ratios) - 1) / 2) * width for g in range(len(labels))]
        shown = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        bars = ax.bar(
            [x for x, _ in shown],
            [v - 1.0 for _, v in shown],
            width,
            bottom=1.0,
            label=f"{names[backend]}",
            color=MODEL_COLOURS.get(backend, "black"),
        )
        ax.bar_label(bars, labels=[f"{v:.2f}x" for _, v in shown], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", linewidth=1.2, linestyle="--", label="stock processor (SDPA) = 1.0")
    ax.set_yscale("log")
    low, high = min([*shown_values, 1.0]) / 1.25, max([*shown_values, 1.0]) * 1.6
    ax.set_ylim(low, high)
    ticks = [t for t in (0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.5, 2, 3, 4, 5, 6, 8, 10) if low <= t <= high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:g}x" for t in ticks])
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("time per transformer forward / stock's\n(below 1: faster than stock)")
    gpu, weights = records[0].get("gpu", "GPU"), records[0].get("model_dtype", "")
    ax.set_title(title or f"FLUX.2 transformer forward on {gpu}, {weights} weights, against stock")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncol=len(ratios) + 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("results", type=Path, nargs="+", help="JSON files from bench_kernel.py / bench_model.py")
    parser.add_argument("--plot", type=Path, help="write the kernel TFLOP/s plot here (PNG)")
    parser.add_argument("--model-plot", type=Path, help="write the end-to-end ratio-to-stock plot here (PNG)")
    parser.add_argument("--stack-plot", type=Path, help="write bench_stack.py's ratio-to-stock plot here (PNG)")
    args = parser.parse_args()
    records = [r for path in args.results for r in json.loads(path.read_text())]
    kernel = [r for r in records if r["suite"] == "kernel"]
    model = [r for r in records if r["suite"] == "model"]
    stack = [r for r in records if r["suite"] == "stack"]
    if kernel:
        print(kernel_table(kernel), end="\n\n")
    if model:
        print(model_table(model))
    if args.plot and kernel:
        plot(kernel, args.plot)
    if stack:
        print(stack_table(stack))
    if args.model_plot and model:
        model_plot(model, args.model_plot)
    if args.stack_plot and stack:
        gpu = stack[0].get("gpu", "GPU")
        model_plot(stack_as_model(stack), args.stack_plot, f"klein step, compiled, on {gpu}: pictor against stock")


if __name__ == "__main__":
    main()
