"""Stack benchmark: a klein transformer step as speed-seeking users run it, stock against pictor.

Every backend runs compiled (`torch.compile(model, fullgraph=True, dynamic=False)`; `--regional`
compiles each repeated block instead, as diffusers' `compile_repeated_blocks` does), with the
blocks' Linear layers in bf16 and then as torchao fp8 (e4m3, per-row scales, dynamic
activations: `pictor_diffusers.testing.fp8_linears`). Backends: `stock` (diffusers' processors,
SDPA), `pictor_bf16` and `pictor_fp8` (`PictorAttn(precision=...)`). Random bf16 weights in
klein-4B or klein-9B shape, 512 text tokens plus the image's tokens (1024² -> 4096). One image
size per process, so every ratio in a file comes from one run on one GPU.

Per record: `ms` (median of `--reps` forwards after the compiling call), `x_stock` (over stock's ms
with the same linears), `rel_l2_vs_stock` (against stock's output with the same linears),
`compile_s` (wall time of the first, compiling call).

    python benchmarks/bench_stack.py --model klein-4B --image 1024 --json benchmarks/results/h100_stack.json
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_kernel import environment
from bench_model import MODEL_CONFIGS, TEXT_TOKENS, set_backend

from pictor_diffusers.testing.fp8_linears import quantize_block_linears
from pictor_diffusers.testing.models import build_transformer, transformer_inputs
from pictor_diffusers.testing.timing import median_ms

BACKENDS = ("stock", "pictor_bf16", "pictor_fp8")
OTHER_BACKENDS = ("pictor_fp32",)
"""Run only when named: the parity path (`PictorAttn()`), for its compiled-step records."""
LINEARS = ("bf16", "fp8")


def build(name: str, blocks: tuple[int, int] | None, linears: str, tune_inductor: bool) -> torch.nn.Module:
    """The bf16 transformer on the GPU, its block Linear layers quantised to fp8 when `linears` is "fp8"."""
    config = dict(MODEL_CONFIGS[name])
    if blocks is not None:
        config["num_layers"], config["num_single_layers"] = blocks
    with torch.device("cuda"):
        model = build_transformer(config, dtype=torch.bfloat16)
    if linears == "fp8":
        quantize_block_linears(model, tune_inductor=tune_inductor)
    return model


def compiled(model: torch.nn.Module, regional: bool, mode: str | None) -> torch.nn.Module:
    """`model` compiled whole, or its repeated blocks compiled in place (`regional`)."""
    torch._dynamo.reset()
    if regional:
        model.compile_repeated_blocks(fullgraph=True, dynamic=False, mode=mode)
        return model
    return torch.compile(model, fullgraph=True, dynamic=False, mode=mode)


def run(model: torch.nn.Module, inputs: dict, backend: str, args: argparse.Namespace) -> tuple[torch.Tensor, dict]:
    """(output, timings) of one backend: the compiling call's seconds, then the median ms."""
    set_backend(model, backend)
    runner = compiled(model, args.regional, args.mode)
    start = time.perf_counter()
    out = runner(**inputs)[0]
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - start
    ms = median_ms(lambda: runner(**inputs), warmup=2, timed=args.reps, hold=False)
    return out, {"ms": ms, "compile_s": compile_s, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def bench_linears(linears: str, args: argparse.Namespace, emit: Callable[[dict], None]) -> None:
    """Every backend on one model with `linears`, each record passed to `emit`; stock first, as the ratios' base."""
    model = build(args.model, args.blocks, linears, args.tune_inductor)
    latent = args.image // 16
    inputs = transformer_inputs(model, batch=1, latent_hw=(latent, latent), text_len=TEXT_TOKENS)
    stock = None
    for backend in ["stock", *(b for b in args.backends if b != "stock")]:
        torch.cuda.reset_peak_memory_stats()
        out, timing = run(model, inputs, backend, args)
        stock = (out.double(), timing["ms"]) if backend == "stock" else stock
        rel_l2 = ((out.double() - stock[0]).norm() / stock[0].norm()).item()
        emit(
            {
                "suite": "stack",
                "model": args.model,
                "blocks": "{}+{}".format(*(args.blocks or (model.config.num_layers, model.config.num_single_layers))),
                "image": args.image,
                "compiled": True,
                "regional": args.regional,
                "mode": args.mode or "default",
                "inductor_tuning": "torchao" if args.tune_inductor else "default",
                "linears": linears,
                "backend": backend,
                **timing,
                "x_stock": timing["ms"] / stock[1],
                "rel_l2_vs_stock": rel_l2,
                "finite": bool(torch.isfinite(out).all()),
            }
        )
        print(
            f"{args.model} {args.image}² linears={linears:4} {backend:>11}: {timing['ms']:8.2f} ms "
            f"x{timing['ms'] / stock[1]:.3f}  rel_l2 {rel_l2:.2e}  compile {timing['compile_s']:6.1f} s",
            flush=True,
        )
        del out
    del model, inputs, stock
    gc.collect()
    torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="klein-4B", choices=["klein-4B", "klein-9B"])
    parser.add_argument("--image", type=int, default=1024, help="image side in pixels (1024, 2048)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {BACKENDS + OTHER_BACKENDS}")
    parser.add_argument("--linears", default=",".join(LINEARS), help=f"comma list of {LINEARS}")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--regional", action="store_true", help="compile the repeated blocks, not the whole model")
    parser.add_argument("--mode", help="torch.compile mode (default: none)")
    parser.add_argument("--tune-inductor", action="store_true", help="torchao's inductor options (slow compiles)")
    parser.add_argument("--blocks", help="D,S: double and single block counts (a shorter model, to study compiles)")
    parser.add_argument("--stacks", type=float, help="print every thread's stack every this many seconds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.backends, args.linears = args.backends.split(","), args.linears.split(",")
    known = BACKENDS + OTHER_BACKENDS
    bad = [b for b in args.backends if b not in known] + [x for x in args.linears if x not in LINEARS]
    if bad:
        raise SystemExit(f"unknown backends or linears: {bad}")
    args.blocks = tuple(int(n) for n in args.blocks.split(",")) if args.blocks else None
    return args


@torch.no_grad()
def main() -> None:
    args = parse_args()
    if args.stacks:
        faulthandler.dump_traceback_later(args.stacks, repeat=True, file=sys.stderr)
    env, records = environment(), []

    def emit(record: dict) -> None:
        """Keep `record` and rewrite the JSON, so a run cut short still leaves what it measured."""
        records.append({**record, **env})
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(records, indent=1))

    for linears in args.linears:
        bench_linears(linears, args, emit)


if __name__ == "__main__":
    main()
