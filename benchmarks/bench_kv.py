"""FLUX.2-klein KV-cache steps: diffusers' KV processors against PictorAttn (random bf16 weights).

klein-4B's shape at a square image plus one reference image of the same size
(512 text tokens, 4096 image and 4096 reference tokens at 1024²). Per backend:
the extract step (step 0: [text, reference, image], reference K/V stored) and
a cached step (later steps: [text, image] over the cached reference K/V),
each the median of CUDA-event-timed forwards after a warm-up; output distance
to stock's.

    python benchmarks/bench_kv.py --json benchmarks/results/h200_kv.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from bench_kernel import environment

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import (
    KLEIN_4B_CONFIG,
    build_transformer,
    image_ids,
    set_kv_processors,
    transformer_inputs,
)
from pictor_diffusers.testing.references import max_abs, rel_l2
from pictor_diffusers.testing.timing import median_ms

TEXT_LEN = 512


def step_inputs(model: torch.nn.Module, side: int) -> tuple[dict, dict, int]:
    """(extract-step inputs, cached-step inputs, reference tokens) for a `side`² image and reference."""
    latent = side // 16
    inputs = transformer_inputs(model, 1, (latent, latent), TEXT_LEN, seed=1)
    param = next(model.parameters())
    generator = torch.Generator().manual_seed(2)
    reference = torch.randn(1, latent * latent, model.config.in_channels, generator=generator)
    ref_ids = image_ids(latent, latent)
    ref_ids[..., 0] = 10
    extract = {
        **inputs,
        "hidden_states": torch.cat([reference.to(param.device, param.dtype), inputs["hidden_states"]], dim=1),
        "img_ids": torch.cat([ref_ids.to(param.device), inputs["img_ids"]], dim=0),
    }
    return extract, inputs, latent * latent


def run_backend(model: torch.nn.Module, name: str, side: int, reps: int) -> dict:
    if name == "stock":
        set_kv_processors(model)
    else:
        model.set_attn_processor(PictorAttn(precision="bf16" if name == "pictor_bf16" else "fp32"))
    extract, cached, ref_len = step_inputs(model, side)
    with torch.no_grad():
        out_extract, cache = model(**extract, kv_cache_mode="extract", num_ref_tokens=ref_len)
        out_cached = model(**cached, kv_cache=cache, kv_cache_mode="cached")[0]
        extract_step = partial(model, **extract, kv_cache_mode="extract", num_ref_tokens=ref_len)
        extract_ms = median_ms(extract_step, warmup=1, timed=reps, hold=False)
        cached_ms = median_ms(partial(model, **cached, kv_cache=cache, kv_cache_mode="cached"), 1, reps, hold=False)
    return {"backend": name, "extract_ms": extract_ms, "cached_ms": cached_ms, "outputs": (out_extract, out_cached)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=1024)
    parser.add_argument("--backends", default="stock,pictor_bf16,pictor_fp32")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = build_transformer(KLEIN_4B_CONFIG, device="cuda", dtype=torch.bfloat16)
    rows = [run_backend(model, name, args.side, args.reps) for name in args.backends.split(",")]
    stock_outputs, stock_ms = rows[0]["outputs"], rows[0]["cached_ms"]
    records = []
    for row in rows:
        outputs = row.pop("outputs")
        distances = {
            f"{mode}_{metric.__name__}": metric(out, ref)
            for mode, out, ref in zip(("extract", "cached"), outputs, stock_outputs, strict=True)
            for metric in (max_abs, rel_l2)
        }
        record = {"suite": "kv", "model": "klein-4B", "image": args.side, "reference_images": 1, **row, **distances}
        record |= {"cached_x_stock": row["cached_ms"] / stock_ms, **environment()}
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k not in environment()}))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
