"""Attention layers of other DiTs, and the FLUX.1-dev transformer, through diffusers' dispatcher: native backend
against pictor's backends (the layers: `layer_cases.py`).

Random bf16 weights and inputs, GPU time (CUDA events, warm-up, median; host time included for the whole
transformer), on the current GPU:

* `wan-self`: a Wan2.1-14B `WanAttention` self-attention (dim 5120, 40 heads of 128) over `--wan-tokens`
  video tokens (default 32760: 81 frames at 720x1280 after the VAE and 1x2x2 patches), projections included;
* `wan-cross`: the same layer's text cross-attention, the video tokens over 512 text tokens (Nq != Nk);
* `qwen-masked`: Qwen-Image's joint attention call (24 heads of 128, batch 2, 4096 image tokens after
  a text of 256 tokens padded to different lengths), with its `[B, 1, 1, Nk]` bool key-padding mask;
* `ltx-block`: an LTX-Video block (32 heads of 64, B2, 6144 video tokens; 128 text tokens under its additive
  float mask, `[B, 32, 1, 128]`);
* `sd35-joint`: SD3.5's joint attention (B2, 24 heads of 64, 4096 + 333 tokens); its processor bypasses the
  dispatcher, so this row times SDPA against `pictor_diffusers.attention` (the row's `note` says so);
* `hunyuan-block`: a HunyuanVideo dual-stream block (24 heads of 128, 11520 + 256 tokens, bool text mask);
* `flux1-dev`: the FLUX.1-dev transformer at 1024² (4096 + 512 tokens), one forward.

Each row: native ms, pictor ms per backend, the ratio pictor / native (below 1: pictor is faster), and the relative
L2 of each output (native's too) against the same call with float64 attention, and against native's.

    python benchmarks/bench_layers.py --json benchmarks/results/layers_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from bench_kernel import environment
from layer_cases import BACKENDS, Layer, backend_call, errors, layer_outputs, layers

import pictor_diffusers  # noqa: F401  (registers the backends)
from pictor_diffusers.testing.timing import median_ms


@torch.no_grad()
def measure(name: str, layer: Layer, reps: int) -> dict:
    """One row: times and errors of `layer` on native and each pictor backend."""
    row = {"layer": name, **({"note": layer.note} if layer.note else {})}
    hold = not layer.whole_model
    row["native_ms"] = median_ms(layer.native, warmup=3, timed=reps, hold=hold)
    for backend in BACKENDS:
        row[f"{backend}_ms"] = median_ms(backend_call(layer, backend), warmup=3, timed=reps, hold=hold)
        row[f"{backend}_ratio"] = row[f"{backend}_ms"] / row["native_ms"]
    return {**row, **errors(layer_outputs(layer, BACKENDS))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wan-tokens", type=int, default=32760)
    parser.add_argument("--layers", help="comma-separated rows (default: all)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    builders = layers("cuda", wan_tokens=args.wan_tokens)
    names = args.layers.split(",") if args.layers else list(builders)
    env, records = environment(), []
    for name in names:
        row = measure(name, builders[name](), args.reps)
        records.append({"suite": "layers", **row, **env})
        if args.json:  # rewritten after every row, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(records, indent=2) + "\n")
        gc.collect()
        torch.cuda.empty_cache()
        cells = "  ".join(f"{b} {row[f'{b}_ms']:.3f} ms ({row[f'{b}_ratio']:.3f}x)" for b in BACKENDS)
        print(f"{name}: native {row['native_ms']:.3f} ms  {cells}", flush=True)


if __name__ == "__main__":
    main()
