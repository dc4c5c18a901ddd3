"""Model-level benchmark: one FLUX.2 transformer step, stock processor against PictorAttn.

Random bf16 weights in FLUX.2 shapes (nothing is downloaded); 512 text tokens
plus the image tokens of a square image (1024² -> 4096, 2048² -> 16384).
Per row: median ms per forward (CUDA events, after a warm-up), peak GPU memory,
and the relative L2 difference of PictorAttn's output from stock's.

    python benchmarks/bench_model.py --models klein-4B --sizes 1024 --json benchmarks/results/model.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from flux2_models import KLEIN_4B_CONFIG, TINY_CONFIG, build_transformer, set_stock_processors, transformer_inputs

from pictor_diffusers import PictorAttn

MODEL_CONFIGS = {
    "klein-4B": KLEIN_4B_CONFIG,
    "klein-9B": {
        **KLEIN_4B_CONFIG,
        "num_attention_heads": 32,
        "num_layers": 8,
        "num_single_layers": 24,
        "joint_attention_dim": 12288,
    },
    "dev": {
        **TINY_CONFIG,
        "in_channels": 128,
        "num_layers": 8,
        "num_single_layers": 48,
        "attention_head_dim": 128,
        "num_attention_heads": 48,
        "joint_attention_dim": 15360,
        "timestep_guidance_channels": 256,
        "axes_dims_rope": (32, 32, 32, 32),
    },
}
"""klein-4B as published (24 heads, 5 + 20 blocks); klein-9B and dev as FLUX.2's larger shapes."""


def time_forward(model: torch.nn.Module, inputs: dict, reps: int) -> tuple[torch.Tensor, float, float]:
    """(output, median ms, peak GiB) of `reps` timed forwards after one warm-up."""
    out = model(**inputs)[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(**inputs)[0]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return out, sorted(times)[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


@torch.no_grad()
def bench_model(name: str, sizes: list[int], reps: int) -> list[dict]:
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = build_transformer(MODEL_CONFIGS[name], dtype=torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    records = []
    for size in sizes:
        latent = size // 16
        inputs = transformer_inputs(model, batch=1, latent_hw=(latent, latent), text_len=512)
        set_stock_processors(model)
        stock, stock_ms, stock_gib = time_forward(model, inputs, reps)
        model.set_attn_processor(PictorAttn())
        ours, ours_ms, ours_gib = time_forward(model, inputs, reps)
        rel = ((ours.float() - stock.float()).norm() / stock.float().norm()).item()
        for backend, ms, gib in (("stock", stock_ms, stock_gib), ("pictor_auto", ours_ms, ours_gib)):
            records.append(
                {
                    "suite": "model",
                    "model": name,
                    "backend": backend,
                    "dtype": "bf16",
                    "B": 1,
                    "H": model.config.num_attention_heads,
                    "N": 512 + latent * latent,
                    "D": model.config.attention_head_dim,
                    "image": size,
                    "ms": ms,
                    "peak_gib": gib,
                    "rel_l2_vs_stock": 0.0 if backend == "stock" else rel,
                }
            )
            print(
                f"{name:>8} {size}² {backend:>11} {ms:9.1f} ms  peak {gib:6.1f} GiB  "
                f"rel_l2 vs stock {records[-1]['rel_l2_vs_stock']:.2e}  x{ms / stock_ms:.2f}",
                flush=True,
            )
    del model
    torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="klein-4B", help=f"comma list of {list(MODEL_CONFIGS)}")
    parser.add_argument("--sizes", default="1024,2048", help="image sides in pixels")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    records = [r for name in args.models.split(",") for r in bench_model(name, sizes, args.reps)]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
