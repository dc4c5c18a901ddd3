"""Text-to-image with FLUX.2 through PictorAttn.

    python examples/generate.py --tiny                        # embedded default, any machine
    python examples/generate.py --prompt "a red fox" --out fox.png   # FLUX.2-klein-4B weights
    python examples/generate.py --tiny --compare              # PictorAttn against stock, same seed
    python examples/generate.py --tiny --compare --precision bf16   # the 16-bit fast path

`--model` takes a hub id or a local directory holding any FLUX.2 or FLUX.2 [klein]
pipeline; HF_HUB_OFFLINE=1 is respected. `--tiny` builds a small random-weight
pipeline in code (examples/tiny_flux2.py): its pictures are noise, but it runs
the real denoising loop through PictorAttn.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_flux2 import synthetic_prompt_embeds, tiny_pipeline
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-4B"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local pipeline directory")
    parser.add_argument("--tiny", action="store_true", help="embedded random-weight pipeline (no download)")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn, oil painting")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0, help="seed of the CPU torch.Generator")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cpu-offload", action="store_true", help="enable_model_cpu_offload()")
    parser.add_argument("--compare", action="store_true", help="also run the stock processor, same seed")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16", "auto"),
        default="fp32",
        help="PictorAttn(precision=...): fp32 parity path (default) or the 16-bit fast path",
    )
    parser.add_argument("--out", type=Path, default=Path("flux2_pictor.png"))
    args = parser.parse_args()
    args.dtype = DTYPES[args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")]
    size, steps = (256, 4) if args.tiny else (1024, 4)
    args.height, args.width, args.steps = args.height or size, args.width or size, args.steps or steps
    return args


def load_pipeline(args: argparse.Namespace):
    """The pretrained pipeline, or SystemExit with a message that says how to get it."""
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(args.model, torch_dtype=args.dtype)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"Could not load FLUX.2 weights from {args.model!r}: {error}\n"
            f"Download them first (accept the model's license on the Hub, then "
            f"`hf download {args.model}`), or pass --model with a local pipeline directory.\n"
            "Without weights, `python examples/generate.py --tiny` runs the embedded random-weight pipeline."
        ) from error


def generate(pipe, args: argparse.Namespace, processor: object) -> tuple[Image.Image, float]:
    """One image with `processor` on every attention; returns (image, median ms per step)."""
    pipe.transformer.set_attn_processor(processor)
    stamps: list[float] = []

    def on_step_end(_pipe, _step: int, _timestep: int, kwargs: dict) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return kwargs

    if args.tiny:
        extra = {"prompt_embeds": synthetic_prompt_embeds(args.prompt).to(args.device, args.dtype)}
    else:
        extra = {"prompt": args.prompt}
    start = time.perf_counter()
    image = pipe(
        **extra,
        height=args.height,
        width=args.width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        generator=torch.Generator().manual_seed(args.seed),
        callback_on_step_end=on_step_end,
    ).images[0]
    steps = np.diff([start, *stamps]) * 1e3
    return image, float(np.median(steps))


def compare_images(ours: Image.Image, stock: Image.Image, out: Path | None, label: str = "PictorAttn vs stock") -> None:
    """Print max-abs, mean-abs and PSNR (8-bit scale); write the difference image if `out` is given."""
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(stock, dtype=np.float64)
    diff = np.abs(a - b)
    mse = float((diff**2).mean())
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
    print(f"{label}: max-abs {diff.max():.0f}, mean-abs {diff.mean():.3f} (of 255), PSNR {psnr:.1f} dB")
    if out is None:
        return
    scale = 255.0 / max(diff.max(), 1.0)
    Image.fromarray((diff * scale).astype(np.uint8)).save(out.with_name(out.stem + "_diff.png"))


def main() -> None:
    args = parse_args()
    if args.tiny:
        print("Embedded default: a small FLUX.2 [klein] pipeline with RANDOM weights; the picture is noise.")
        pipe = tiny_pipeline(args.dtype)
    else:
        pipe = load_pipeline(args)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)

    image, ms = generate(pipe, args, PictorAttn(precision=args.precision))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    print(f"PictorAttn: {ms:.1f} ms per step, wrote {args.out}")
    if args.compare:
        stock_out = args.out.with_name(args.out.stem + "_stock.png")
        stock, stock_ms = generate(pipe, args, stock_processors(pipe.transformer))
        stock.save(stock_out)
        print(f"stock: {stock_ms:.1f} ms per step, wrote {stock_out}")
        compare_images(image, stock, args.out)
        with sdpa_kernel(SDPBackend.MATH):
            stock_math, _ = generate(pipe, args, stock_processors(pipe.transformer))
        compare_images(stock_math, stock, None, "yardstick, stock with SDPA's math backend vs stock default")


def stock_processors(transformer: torch.nn.Module) -> dict:
    """diffusers' default processor for each FLUX.2 attention module, by module name."""
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

    processors = {}
    for name in transformer.attn_processors:
        module = transformer.get_submodule(name.removesuffix(".processor"))
        single = type(module).__name__ == "Flux2ParallelSelfAttention"
        processors[name] = Flux2ParallelSelfAttnProcessor() if single else Flux2AttnProcessor()
    return processors


if __name__ == "__main__":
    main()
