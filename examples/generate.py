"""Text-to-image with FLUX.2 through PictorAttn.

    .venv/bin/python examples/generate.py --tiny                     # embedded default, any machine
    .venv/bin/python examples/generate.py --prompt "a red fox"        # FLUX.2-klein-4B weights
    .venv/bin/python examples/generate.py --tiny --compare            # PictorAttn against stock, same seed
    .venv/bin/python examples/generate.py --tiny --compare --precision bf16   # the 16-bit fast path (CUDA)

Images go to outputs/ in the current directory unless --out names a path. An existing
file is replaced only with --overwrite, and each image is written through a temp file
beside it, so a symlink at the path is replaced as a link, never followed.
--model takes a hub id or a local directory holding any FLUX.2 or FLUX.2 [klein]
pipeline; HF_HUB_OFFLINE=1 is respected. --tiny builds a small random-weight
pipeline in code (examples/tiny_flux2.py): its pictures are noise, but it runs
the real denoising loop through PictorAttn.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_flux2 import synthetic_prompt_embeds, tiny_pipeline
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-4B"
DEFAULT_OUT = Path("outputs") / "flux2_pictor.png"
SIZE_MULTIPLE = 16
"""FLUX.2 latents are 2x2 patches of the VAE's 8x-downsampled pixels."""
CPU_FIRST_LINE = (
    "On the CPU, PictorAttn runs its pure-torch reference, not its CUDA kernels: "
    "times here say nothing about its speed on a GPU."
)
CPU_NOTE = "note: CPU timings also swing widely between identical runs (other processes, thread scheduling, clocks)."


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Appends each option's default; an option whose default depends on others states it in its own help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option has help text, and --help shows every default."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local FLUX.2 pipeline directory")
    parser.add_argument("--tiny", action="store_true", help="embedded random-weight pipeline (no download)")
    parser.add_argument(
        "--prompt",
        default="a lighthouse on a cliff at dawn, oil painting",
        help="text prompt; with --tiny (no text encoder) it seeds the synthetic prompt embeddings",
    )
    for side in ("height", "width"):
        parser.add_argument(
            f"--{side}",
            type=int,
            help=f"image {side} in pixels, a multiple of {SIZE_MULTIPLE} (default: 256 with --tiny, else 1024)",
        )
    parser.add_argument("--steps", type=int, default=4, help="denoising steps; the first is timed as warm-up")
    parser.add_argument(
        "--guidance",
        type=float,
        help="guidance scale (default: 1.0 for step-wise distilled models such as FLUX.2 [klein], "
        "which ignore guidance; else 4.0)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the CPU torch.Generator that draws the noise")
    parser.add_argument("--dtype", choices=DTYPES, help="model dtype (default: bf16 on CUDA, fp32 on the CPU)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device to run on"
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="enable_model_cpu_offload(): keep models on the CPU, move each to the CUDA device while it runs "
        "(needs accelerate, in the examples extra)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also run the stock processor with the same seed: writes <out>_stock.png and <out>_diff.png, "
        "|PictorAttn - stock| stretched so the largest difference is full brightness, and prints their distance",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16", "fp8", "auto"),
        default="fp32",
        help="PictorAttn(precision=...): fp32 parity path, the 16-bit fast path or the 8-bit path (CUDA only); "
        "auto: the model dtype's 16-bit path for bf16/fp16 models, else fp32",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="image path, its extension one Pillow writes; --compare writes <stem>_stock.png and <stem>_diff.png "
        "beside it. Its folder must exist (outputs/ is made)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing images (a symlink is replaced, not followed)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show diffusers/transformers log messages and Python warnings"
    )
    return parser


def _size_error(option: str, value: int) -> str:
    lower = max(value // SIZE_MULTIPLE * SIZE_MULTIPLE, SIZE_MULTIPLE)
    nearest = f"{lower}" if value < SIZE_MULTIPLE else f"{lower} or {lower + SIZE_MULTIPLE}"
    return f"{option} must be a positive multiple of {SIZE_MULTIPLE}, got {value}; try {nearest}"


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with a usage error that names the value, for any input the run could not honour."""
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    for option, value in (("--height", args.height), ("--width", args.width)):
        if value is not None and (value <= 0 or value % SIZE_MULTIPLE):
            parser.error(_size_error(option, value))
    if args.cpu_offload:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            parser.error(
                "--cpu-offload needs the accelerate package, which the examples extra installs: "
                f"{sys.executable} -m pip install accelerate"
            )
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        parser.error(
            f"--device {args.device!r}: torch {torch.__version__} ({build}) finds no CUDA device; use --device cpu"
        )
    if args.cpu_offload and not on_cuda:
        parser.error(f"--cpu-offload moves each model to a CUDA device while it runs; --device is {args.device!r}")
    if args.attention_precision != "fp32" and not on_cuda:
        chosen = args.precision
        if chosen == "auto":
            chosen = f"auto with a {args.attention_precision} model (--dtype {args.attention_precision})"
        parser.error(
            f"--precision {chosen} runs the {'8' if chosen == 'fp8' else '16'}-bit CUDA kernels, "
            f"but --device is {args.device!r}; "
            "on the CPU use --precision fp32"
        )


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Stop with a usage error naming the path if any image of the run could not be written where asked."""
    for label, path in output_paths(args):
        problem = out_problem(path, args.overwrite)
        if problem:
            parser.error(f"{label} {str(path)!r}: {problem}")


def output_paths(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label, path) of each image the run writes: --out, and with --compare the stock and difference images."""
    paths = [("--out", args.out)]
    if args.compare:
        paths += [(f"--compare's {kind} image", companion(args.out, kind)) for kind in ("stock", "diff")]
    return paths


def companion(out: Path, kind: str) -> Path:
    """The PNG that --compare writes beside `out`: <stem>_stock.png or <stem>_diff.png."""
    return out.with_name(f"{out.stem}_{kind}.png")


def image_format(path: Path) -> str | None:
    """The Pillow format that writes an RGB image under `path`'s extension, or None if none does."""
    name = Image.registered_extensions().get(path.suffix.lower())
    if name not in Image.SAVE:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated formats warn on every save
            Image.new("RGB", (1, 1)).save(io.BytesIO(), format=name)
    except Exception:  # a plugin that cannot write RGB raises what it likes
        return None
    return name


def writable_extensions() -> str:
    """The extensions under which Pillow writes an RGB image, for error messages."""
    return " ".join(sorted(ext for ext in Image.registered_extensions() if image_format(Path(f"image{ext}"))))


def out_problem(path: Path, overwrite: bool) -> str | None:
    """Why an image cannot be written to `path`, or None if it can."""
    if os.path.isdir(path) and not os.path.islink(path):  # os.path's tests answer False where stat fails
        return f"is a directory; name an image file in it, such as {str(path / DEFAULT_OUT.name)!r}"
    if image_format(path) is None:
        kind = f"{path.suffix!r} files" if path.suffix else "a name without an extension"
        return f"Pillow cannot write {kind}; end it in .png or another of: {writable_extensions()}"
    problem = folder_problem(path.parent)
    if problem:
        return problem
    if os.path.islink(path) and not overwrite:
        return (
            f"is a symbolic link (to {os.readlink(path)!r}); --overwrite replaces the link itself, "
            "its target is never written"
        )
    if os.path.lexists(path) and not overwrite:
        return "exists; pass --overwrite to replace it, or name another file"
    return None


def folder_problem(folder: Path) -> str | None:
    """Why no file can be created in `folder`, or None; a missing outputs/ is fine where it can be made."""
    if not os.path.lexists(folder) and folder == DEFAULT_OUT.parent:
        folder = Path.cwd()
    if not os.path.isdir(folder):
        return f"its folder {str(folder)!r} {'is not a directory' if os.path.lexists(folder) else 'does not exist'}"
    try:
        descriptor, temp = open_temp(folder, "write-check")
    except OSError as error:
        return f"cannot write in its folder {str(folder)!r}: {error.strerror}"
    os.close(descriptor)
    os.unlink(temp)
    return None


def open_temp(folder: Path, name: str) -> tuple[int, Path]:
    """A new hidden file in `folder`, opened for writing (never an existing file or a symlink's target)."""
    temp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(temp, flags, 0o666), temp


def save_image(image: Image.Image, path: Path, overwrite: bool) -> None:
    """Write `image` to a temp file beside `path`, then `os.replace` it onto `path`.

    No partial file is ever at `path`, and a symlink there is replaced as a link, its target never written.
    """
    if path.parent == DEFAULT_OUT.parent:
        path.parent.mkdir(exist_ok=True)
    descriptor, temp = open_temp(path.parent, path.name)
    try:
        with os.fdopen(descriptor, "wb") as file:
            image.save(file, format=image_format(path))
        if not overwrite and os.path.lexists(path):
            raise FileExistsError("it appeared during the run; pass --overwrite to replace it")
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def write(image: Image.Image, path: Path, overwrite: bool) -> None:
    """`save_image`, or exit with an error naming `path` (a folder removed or filled during the run)."""
    try:
        save_image(image, path, overwrite)
    except OSError as error:
        sys.exit(f"{Path(sys.argv[0]).name}: error: could not write {str(path)!r}: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed, checked arguments with the model-dependent defaults filled in (guidance: once the model is known)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    dtype_name = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.dtype = DTYPES[dtype_name]
    if args.precision == "auto":
        args.attention_precision = dtype_name if dtype_name in ("bf16", "fp16") else "fp32"
    else:
        args.attention_precision = args.precision
    check_args(parser, args)
    check_outputs(parser, args)
    size = 256 if args.tiny else 1024
    args.height, args.width = args.height or size, args.width or size
    return args


def quiet(verbose: bool) -> None:
    """Unless `verbose`: diffusers and transformers log only errors, and their Python warnings are hidden.

    RuntimeWarnings stay visible: pictor's own (a kernel fallback, a CuPy/torch CUDA mismatch) are of that kind.
    """
    if verbose:
        return
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.set_verbosity_error()
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)


def load_pipeline(args: argparse.Namespace) -> DiffusionPipeline:
    """The pretrained pipeline, or SystemExit with a message that says how to get it."""
    from diffusers import DiffusionPipeline

    try:
        return DiffusionPipeline.from_pretrained(args.model, torch_dtype=args.dtype)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"Could not load FLUX.2 weights from {args.model!r}: {error}\n"
            f"Download them first (accept the model's license on the Hub, then "
            f"`hf download {args.model}`), or pass --model with a local pipeline directory.\n"
            "Without weights, run this script with --tiny: the embedded random-weight pipeline."
        ) from error


def default_guidance(pipe: DiffusionPipeline) -> float:
    """1.0 for step-wise distilled pipelines (FLUX.2 [klein] ignores guidance above 1 and warns), else 4.0."""
    return 1.0 if getattr(pipe.config, "is_distilled", False) else 4.0


def generate(
    pipe: DiffusionPipeline, args: argparse.Namespace, processor: object, label: str
) -> tuple[Image.Image, list[float]]:
    """One image with `processor` on every attention, under a progress bar named `label`; (image, ms per step)."""
    pipe.transformer.set_attn_processor(processor)
    pipe.set_progress_bar_config(desc=label)
    stamps: list[float] = []
    on_cuda = args.device.startswith("cuda")

    def on_step_end(_pipe: DiffusionPipeline, _step: int, _timestep: int, kwargs: dict) -> dict:
        if on_cuda:
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
    return image, (np.diff([start, *stamps]) * 1e3).tolist()


def step_time(ms: list[float]) -> str:
    """The median time per step after the first step (the warm-up: compiles, caches, prompt encoding)."""
    if len(ms) < 2:
        return f"{ms[0]:.1f} ms for its only step, warm-up included (--steps 2 or more to time steps after it)"
    timed = "the step" if len(ms) == 2 else f"median of the {len(ms) - 1} steps"
    return f"{float(np.median(ms[1:])):.1f} ms per step ({timed} after a warm-up step)"


def difference_summary(diff: np.ndarray) -> str:
    """How many 8-bit values differ and by how much: max-abs, mean-abs (of 255) and PSNR."""
    changed = int(np.count_nonzero(diff))
    if changed == 0:
        return f"0 of {diff.size:,} values differ: the images are identical"
    mse = float((diff**2).mean())
    psnr = 10 * np.log10(255.0**2 / mse)
    return (
        f"{changed:,} of {diff.size:,} values differ ({changed / diff.size:.3%}), by at most {diff.max():.0f} "
        f"of 255; mean-abs {diff.mean():.2g}, PSNR {psnr:.1f} dB"
    )


def compare_images(
    ours: Image.Image, stock: Image.Image, out: Path | None, overwrite: bool = False, label: str = "PictorAttn vs stock"
) -> None:
    """Print how the two images differ; write the stretched difference image if `out` is given."""
    diff = np.abs(np.asarray(ours, dtype=np.float64) - np.asarray(stock, dtype=np.float64))
    print(f"{label}: {difference_summary(diff)}")
    if out is None:
        return
    scale = 255.0 / max(diff.max(), 1.0)
    write(Image.fromarray((diff * scale).astype(np.uint8)), out, overwrite)
    if diff.max() == 0:
        print(f"wrote {out}: all black, the images are identical")
    else:
        print(
            f"wrote {out}: |PictorAttn - stock| per pixel and colour channel, stretched x{scale:.0f} "
            f"so the largest difference ({diff.max():.0f} of 255) is full brightness; black is identical"
        )


def stock_processors(transformer: torch.nn.Module) -> dict:
    """diffusers' default processor for each FLUX.2 attention module, by module name."""
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

    processors = {}
    for name in transformer.attn_processors:
        module = transformer.get_submodule(name.removesuffix(".processor"))
        single = type(module).__name__ == "Flux2ParallelSelfAttention"
        processors[name] = Flux2ParallelSelfAttnProcessor() if single else Flux2AttnProcessor()
    return processors


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_cpu = not args.device.startswith("cuda")
    if on_cpu:
        print(CPU_FIRST_LINE)
    quiet(args.verbose)
    if args.tiny:
        print("Embedded default: a small FLUX.2 [klein] pipeline with RANDOM weights; the picture is noise.")
        pipe = tiny_pipeline(args.dtype)
    else:
        pipe = load_pipeline(args)
    if args.guidance is None:
        args.guidance = default_guidance(pipe)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)

    precision = args.attention_precision
    image, ms = generate(pipe, args, PictorAttn(precision=args.precision), f"pictor {precision}")
    write(image, args.out, args.overwrite)
    print(f"PictorAttn(precision={args.precision!r}): {step_time(ms)}; wrote {args.out}")
    if args.compare:
        stock_out = companion(args.out, "stock")
        stock, stock_ms = generate(pipe, args, stock_processors(pipe.transformer), "stock")
        write(stock, stock_out, args.overwrite)
        print(f"stock: {step_time(stock_ms)}; wrote {stock_out}")
        compare_images(image, stock, companion(args.out, "diff"), args.overwrite)
        with sdpa_kernel(SDPBackend.MATH):
            stock_math, _ = generate(pipe, args, stock_processors(pipe.transformer), "stock, SDPA math")
        dtype = str(args.dtype).removeprefix("torch.")
        label = f"yardstick ({dtype} model), stock with SDPA's math backend vs default"
        compare_images(stock_math, stock, None, label=label)
    if on_cpu:
        print(CPU_NOTE)


if __name__ == "__main__":
    main()
