"""Attention layers of other DiTs through diffusers' dispatcher: native backend against pictor's backends.

Random bf16 weights and inputs, GPU time (CUDA events, warm-up, median), on the current GPU:

* `wan-self`: a Wan2.1-14B `WanAttention` self-attention (dim 5120, 40 heads of 128) over `--wan-tokens`
  video tokens (default 32760: 81 frames at 720x1280 after the VAE and 1x2x2 patches), projections included;
* `wan-cross`: the same layer's text cross-attention, the video tokens over 512 text tokens (Nq != Nk);
* `qwen-masked`: Qwen-Image's joint attention call (24 heads of 128, batch 2, 4096 image tokens after
  a text of 256 tokens padded to different lengths), with its `[B, 1, 1, Nk]` bool key-padding mask.

Each row: native ms, pictor ms per backend, and the ratio pictor / native (below 1: pictor is faster), plus
the relative L2 of each output against native's.

    python benchmarks/bench_layers.py --json benchmarks/results/layers_h200.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

import pictor_diffusers  # noqa: F401  (registers the backends)
from pictor_diffusers.testing.references import rel_l2
from pictor_diffusers.testing.timing import median_ms

BACKENDS = ("pictor_bf16", "pictor")


def wan_layers(tokens: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The self- and cross-attention calls of one Wan2.1-14B block, bf16 on CUDA."""
    torch.manual_seed(0)
    options = {"device": "cuda", "dtype": torch.bfloat16}
    layer = {"dim": 5120, "heads": 40, "dim_head": 128, "eps": 1e-6}
    self_attn = WanAttention(**layer, processor=WanAttnProcessor()).to(**options).eval()
    cross_attn = WanAttention(**layer, cross_attention_dim_head=128, processor=WanAttnProcessor())
    cross_attn = cross_attn.to(**options).eval()
    video = torch.randn(1, tokens, 5120, **options)
    text = torch.randn(1, 512, 5120, **options)
    return {"wan-self": lambda: self_attn(video), "wan-cross": lambda: cross_attn(video, text)}


def qwen_masked_call() -> Callable[[], torch.Tensor]:
    """Qwen-Image's joint attention on [text | image] with the text padded: 256 and 97 real text tokens."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    shape = (2, 256 + 4096, 24, 128)
    query, key, value = (torch.randn(shape, device="cuda", generator=generator, dtype=torch.bfloat16) for _ in "qkv")
    mask = torch.ones(2, 1, 1, shape[1], dtype=torch.bool, device="cuda")
    mask[1, ..., 97:256] = False
    return lambda: dispatch_attention_fn(query, key, value, attn_mask=mask)


@torch.no_grad()
def measure(name: str, call: Callable[[], torch.Tensor], reps: int) -> dict:
    native_out = call()
    row = {"layer": name, "native_ms": median_ms(call, warmup=3, timed=reps)}
    for backend in BACKENDS:
        with attention_backend(backend):
            out = call()
            row[f"{backend}_ms"] = median_ms(call, warmup=3, timed=reps)
        row[f"{backend}_ratio"] = row[f"{backend}_ms"] / row["native_ms"]
        row[f"{backend}_rel_l2_vs_native"] = rel_l2(out, native_out)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wan-tokens", type=int, default=32760)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    calls = {**wan_layers(args.wan_tokens), "qwen-masked": qwen_masked_call()}
    rows = []
    for name, call in calls.items():
        row = measure(name, call, args.reps)
        rows.append(row)
        cells = "  ".join(f"{b} {row[f'{b}_ms']:.3f} ms ({row[f'{b}_ratio']:.3f}x)" for b in BACKENDS)
        print(f"{name}: native {row['native_ms']:.3f} ms  {cells}", flush=True)
    if args.json:
        record = {"suite": "layers", "device": torch.cuda.get_device_name(), "rows": rows}
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
