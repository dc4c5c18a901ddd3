"""Model-level benchmark: one FLUX.2 or FLUX.1 transformer step, stock processor against pictor.

Random bf16 weights in FLUX.2 shapes or FLUX.1-dev's (`flux1-dev`; nothing is
downloaded); 512 text tokens plus the image tokens of a square image
(1024² -> 4096, 2048² -> 16384). Backends: `stock` (diffusers' processors on
the native backend, SDPA's default), `stock_math` (the same on SDPA's math
backend; opt-in), `pictor_fp32` (PictorAttn(precision="fp32"), the parity
path), `pictor_bf16` (PictorAttn(precision="bf16"), the fast path), `pictor_fp8`
(PictorAttn(precision="fp8"), the 8-bit path), and `backend_pictor` /
`backend_pictor_bf16` / `backend_pictor_fp8` (the stock processors with
`model.set_attention_backend("pictor" / "pictor_bf16" / "pictor_fp8")`).
`--compile`: every backend, stock included, runs `torch.compile(model, fullgraph=True)` (compiled in the
warm-up call, not timed). `--fp32-reference`: each row also gets `rel_l2_fp32`, its output against the same
weights run in float32 with the stock processors (SDPA in float32).
Default backends: stock,pictor_fp32,pictor_bf16 for FLUX.2; stock,backend_pictor_bf16,pictor_bf16 for FLUX.1.
Per row: median ms per forward (CUDA events, after a warm-up), `x_stock` (ms /
stock's ms), peak GPU memory, max-abs and relative L2 of the output against
stock's, and `tflops`: the attention FLOPs of the whole forward (4·B·H·N²·D
per block) over the forward time (`tflops_basis` says so).

    python benchmarks/bench_model.py --models klein-4B --sizes 1024 --json benchmarks/results/model.json
    python benchmarks/bench_model.py --models flux1-dev --sizes 1024 --json benchmarks/results/flux1_model.json
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch
from bench_kernel import environment
from diffusers import FluxTransformer2DModel
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.models import (
    FLUX1_DEV_CONFIG,
    KLEIN_4B_CONFIG,
    TINY_CONFIG,
    build_flux1_transformer,
    build_transformer,
    flux1_transformer_inputs,
    set_flux1_stock_processors,
    set_stock_processors,
    transformer_inputs,
)
from pictor_diffusers.testing.references import attention_flops
from pictor_diffusers.testing.timing import median_ms

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
    "flux1-dev": FLUX1_DEV_CONFIG,
}
"""klein-4B as published (24 heads, 5 + 20 blocks, 3.9B parameters); klein-9B (9.1B) and dev (32B)
as FLUX.2's larger shapes; flux1-dev: FLUX.1-dev (24 heads, 19 + 38 blocks, 11.9B)."""
FLUX1_MODELS = {"flux1-dev"}
DEFAULT_BACKENDS = {"flux2": "stock,pictor_fp32,pictor_bf16", "flux1": "stock,backend_pictor_bf16,pictor_bf16"}

BACKENDS = {
    "stock": ("stock", "bf16"),
    "stock_math": ("stock", "bf16"),
    "pictor_fp32": ("PictorAttn(precision='fp32')", "fp32"),
    "pictor_bf16": ("PictorAttn(precision='bf16')", "bf16"),
    "pictor_fp8": ("PictorAttn(precision='fp8')", "fp8"),
    "backend_pictor": ("set_attention_backend('pictor')", "fp32"),
    "backend_pictor_bf16": ("set_attention_backend('pictor_bf16')", "bf16"),
    "backend_pictor_fp8": ("set_attention_backend('pictor_fp8')", "fp8"),
}
"""backend -> (processor, dtype attention runs in)."""
TEXT_TOKENS = 512


def time_forward(model: torch.nn.Module, inputs: dict, reps: int) -> tuple[torch.Tensor, float, float]:
    """(output, median ms, peak GiB) of `reps` timed forwards after one warm-up."""
    out = model(**inputs)[0]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(lambda: model(**inputs), warmup=0, timed=reps, hold=False)
    return out, ms, torch.cuda.max_memory_allocated() / 2**30


def set_backend(model: torch.nn.Module, backend: str) -> None:
    """Put `backend`'s processors on `model`; diffusers' active backend is native unless `backend` sets one."""
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)  # set_attention_backend sets it
    if backend.startswith("pictor_"):
        model.set_attn_processor(PictorAttn(precision=backend.removeprefix("pictor_")))
        return
    if isinstance(model, FluxTransformer2DModel):
        set_flux1_stock_processors(model)
    else:
        set_stock_processors(model)
    if backend.startswith("backend_"):
        model.set_attention_backend(backend.removeprefix("backend_"))


def run_backend(
    model: torch.nn.Module, inputs: dict, backend: str, reps: int, compile_model: bool = False
) -> tuple[torch.Tensor, float, float]:
    set_backend(model, backend)
    runner = model
    if compile_model:
        torch._dynamo.reset()
        runner = torch.compile(model, fullgraph=True)
    if backend == "stock_math":
        with sdpa_kernel(SDPBackend.MATH):
            return time_forward(runner, inputs, reps)
    return time_forward(runner, inputs, reps)


def fp32_reference(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's output with its weights and inputs in float32 and the stock processors; the model is
    returned to bfloat16 (bf16 -> f32 -> bf16 is exact)."""
    set_backend(model, "stock")
    model.float()
    try:
        upcast = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
        return model(**upcast)[0]
    finally:
        model.to(torch.bfloat16)


@torch.no_grad()
def bench_model(
    name: str, sizes: list[int], backends: list[str], reps: int, compile_model: bool = False, reference: bool = False
) -> list[dict]:
    flux1 = name in FLUX1_MODELS
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        build = build_flux1_transformer if flux1 else build_transformer
        model = build(MODEL_CONFIGS[name], dtype=torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    config = model.config
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    blocks = config.num_layers + config.num_single_layers
    records = []
    for size in sizes:
        latent = size // 16
        seq = TEXT_TOKENS + latent * latent
        make_inputs = flux1_transformer_inputs if flux1 else transformer_inputs
        inputs = make_inputs(model, batch=1, latent_hw=(latent, latent), text_len=TEXT_TOKENS)
        stock = stock_ms = None
        exact = fp32_reference(model, inputs).double() if reference else None
        for backend in ["stock", *(b for b in backends if b != "stock")]:
            out, ms, gib = run_backend(model, inputs, backend, reps, compile_model)
            if backend == "stock":
                stock, stock_ms = out, ms
            diff = out.double() - stock.double()
            processor, attention_dtype = BACKENDS[backend]
            record = {
                "suite": "model",
                "model": name,
                "backend": backend,
                "processor": processor,
                "dtype": attention_dtype,
                "model_dtype": "bf16",
                "B": 1,
                "H": heads,
                "N": seq,
                "D": head_dim,
                "image": size,
                "ms": ms,
                "x_stock": ms / stock_ms,
                "tflops": blocks * attention_flops(1, heads, seq, head_dim) / ms / 1e9,
                "tflops_basis": f"attention FLOPs of {blocks} blocks / forward time",
                "max_abs": diff.abs().max().item(),
                "rel_l2": (diff.norm() / stock.double().norm()).item(),
                "finite": bool(torch.isfinite(out).all()),
                "peak_gib": gib,
                "compiled": compile_model,
            }
            if exact is not None:
                record["rel_l2_fp32"] = ((out.double() - exact).norm() / exact.norm()).item()
            records.append(record)
            print(
                f"{name:>9} {size}² {backend:>19} {ms:9.1f} ms  peak {gib:6.1f} GiB  "
                f"rel_l2 {record['rel_l2']:.2e} max_abs {record['max_abs']:.2e}  x{ms / stock_ms:.2f}"
                + (f"  rel_l2_fp32 {record['rel_l2_fp32']:.2e}" if exact is not None else "")
                + ("  (compiled)" if compile_model else ""),
                flush=True,
            )
            del out, diff
        del stock, inputs
    set_backend(model, "stock")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="klein-4B,klein-9B,dev", help=f"comma list of {list(MODEL_CONFIGS)}")
    parser.add_argument("--sizes", default="1024", help="image sides in pixels (1024, 2048)")
    parser.add_argument(
        "--backends",
        help=f"comma list of {list(BACKENDS)} (default: {DEFAULT_BACKENDS['flux2']} for FLUX.2, "
        f"{DEFAULT_BACKENDS['flux1']} for FLUX.1)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True) every backend")
    parser.add_argument("--fp32-reference", action="store_true", help="also compare each output to float32 stock")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    models = args.models.split(",")
    chosen = {
        name: (args.backends or DEFAULT_BACKENDS["flux1" if name in FLUX1_MODELS else "flux2"]).split(",")
        for name in models
    }
    unknown = [b for b in set().union(*chosen.values()) if b not in BACKENDS]
    unknown += [m for m in models if m not in MODEL_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown backends or models: {sorted(unknown)}")
    records = [
        r
        for name in models
        for r in bench_model(name, sizes, chosen[name], args.reps, args.compile, args.fp32_reference)
    ]
    env = environment()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**r, **env} for r in records], indent=1))


if __name__ == "__main__":
    main()
