"""examples/generate.py's command line: each input check stops with a message naming the value; --help shows defaults.
The checks of --out and of --compare's images beside it are issue 30's item 8.

The checks run in-process on `parse_args`, so each test fails if its check is removed. Each test runs in an empty
folder, so the default --out (outputs/flux2_pictor.png) never exists beforehand.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from generate_script import PRECIOUS, files_in, load_generate, usage_error

pytest.importorskip("transformers", reason="the FLUX.2 pipelines import transformers (extra: examples)")


@pytest.fixture(scope="module")
def generate() -> types.ModuleType:
    return load_generate()


@pytest.fixture(autouse=True)
def in_empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_below_one_are_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], steps: str
) -> None:
    assert f"--steps must be at least 1, got {steps}" in usage_error(generate, capsys, "--steps", steps)


SIZE_CASES = [
    ("--height", "100", "try 96 or 112"),
    ("--width", "100", "try 96 or 112"),
    ("--height", "0", "try 16"),
    ("--width", "-16", "try 16"),
    ("--height", "8", "try 16"),
]


@pytest.mark.parametrize(("option", "value", "hint"), SIZE_CASES)
def test_sizes_must_be_positive_multiples_of_16(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], option: str, value: str, hint: str
) -> None:
    error = usage_error(generate, capsys, option, value)
    assert f"{option} must be a positive multiple of 16, got {value}; {hint}" in error


def test_valid_input_passes_with_the_model_dependent_defaults(generate: types.ModuleType) -> None:
    args = generate.parse_args(["--tiny", "--height", "64", "--steps", "1", "--device", "cpu"])
    assert (args.height, args.width, args.steps) == (64, 256, 1)
    assert args.dtype == torch.float32 and args.attention_precision == "fp32"
    assert args.out == Path("outputs") / "flux2_pictor.png"
    assert args.guidance is None, "guidance is filled in from the loaded pipeline"


@pytest.mark.parametrize(("precision", "bits"), [("bf16", 16), ("fp16", 16), ("fp8", 8)])
def test_fast_precisions_on_the_cpu_are_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], precision: str, bits: int
) -> None:
    error = usage_error(generate, capsys, "--precision", precision, "--device", "cpu")
    assert f"--precision {precision} runs the {bits}-bit CUDA kernels, but --device is 'cpu'" in error


def test_auto_precision_of_a_16bit_model_on_the_cpu_is_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    error = usage_error(generate, capsys, "--precision", "auto", "--dtype", "bf16", "--device", "cpu")
    assert "--precision auto with a bf16 model (--dtype bf16) runs the 16-bit CUDA kernels" in error


def test_auto_precision_of_an_fp32_model_on_the_cpu_is_fp32(generate: types.ModuleType) -> None:
    assert generate.parse_args(["--precision", "auto", "--device", "cpu"]).attention_precision == "fp32"


def test_cpu_offload_without_accelerate_names_the_package(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # makes `import accelerate` raise ImportError
    error = usage_error(generate, capsys, "--cpu-offload")
    assert "--cpu-offload needs the accelerate package" in error
    assert "examples" in error


def test_cpu_offload_needs_a_cuda_device(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", types.ModuleType("accelerate"))
    error = usage_error(generate, capsys, "--cpu-offload", "--device", "cpu")
    assert "--cpu-offload moves each model to a CUDA device while it runs; --device is 'cpu'" in error


def test_cuda_device_without_cuda_is_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    error = usage_error(generate, capsys, "--device", "cuda:0")
    assert "--device 'cuda:0'" in error and "finds no CUDA device; use --device cpu" in error


def option_blocks(help_text: str) -> dict[str, str]:
    """--help's text for each long option, whitespace collapsed."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        match = re.match(r"\s{2}(?:-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = ""
        if current:
            blocks[current] += " " + line.strip()
    return {option: " ".join(text.split()) for option, text in blocks.items()}


def test_help_gives_every_option_help_text_and_its_default(generate: types.ModuleType) -> None:
    parser: argparse.ArgumentParser = generate.build_parser()
    blocks = option_blocks(parser.format_help())
    options = [action for action in parser._actions if action.dest != "help"]
    assert len(options) >= 15
    for action in options:
        option = action.option_strings[-1]
        assert action.help, f"{option} has no help text"
        assert "(default:" in blocks[option], f"--help shows no default for {option}: {blocks[option]!r}"
    assert "(default: 4)" in blocks["--steps"]
    assert "(default: 256 with --tiny, else 1024)" in blocks["--height"]
    assert "(default: outputs/flux2_pictor.png)" in blocks["--out"]


# --out (issue 30, item 8): every image path is checked before anything loads.


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder in which no file can be created: a read-only one, or for root (who writes anyway) /sys."""
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    for candidate in (folder, Path("/sys")):
        try:
            (candidate / ".probe").touch()
        except OSError:
            return candidate
        (candidate / ".probe").unlink()
    pytest.skip("no folder here refuses new files")


@pytest.mark.parametrize(
    ("out", "refusal"),
    [
        ("x.xyz", "Pillow cannot write '.xyz' files"),
        ("picture", "Pillow cannot write a name without an extension"),
        ("x.xbm", "Pillow cannot write '.xbm' files"),  # registered, but XBM takes only 1-bit images
    ],
)
def test_an_extension_pillow_cannot_write_is_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], out: str, refusal: str
) -> None:
    error = usage_error(generate, capsys, "--out", out)
    assert f"--out {out!r}: {refusal}; end it in .png or another of:" in error
    assert ".jpg" in error and ".webp" in error


def test_a_directory_is_refused(generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "pictures.png").mkdir()
    error = usage_error(generate, capsys, "--out", "pictures.png")
    assert "--out 'pictures.png': is a directory; name an image file in it" in error


def test_a_missing_folder_is_refused_and_not_made(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    error = usage_error(generate, capsys, "--out", "typo/x.png")
    assert "--out 'typo/x.png': its folder 'typo' does not exist" in error
    assert files_in(tmp_path) == []


def test_a_folder_that_is_a_file_is_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "notes").write_bytes(PRECIOUS)
    error = usage_error(generate, capsys, "--out", "notes/x.png")
    assert "--out 'notes/x.png': its folder 'notes' is not a directory" in error


def test_an_unwritable_folder_is_refused(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = str(unwritable_folder(tmp_path) / "x.png")
    error = usage_error(generate, capsys, "--out", out)
    assert f"--out {out!r}: cannot write in its folder" in error


def test_an_existing_file_is_refused_unless_overwrite(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "x.png").write_bytes(PRECIOUS)
    error = usage_error(generate, capsys, "--out", "x.png")
    assert "--out 'x.png': exists; pass --overwrite to replace it" in error
    assert generate.parse_args(["--tiny", "--out", "x.png", "--overwrite"]).overwrite
    assert (tmp_path / "x.png").read_bytes() == PRECIOUS


def test_a_symlink_is_refused_unless_overwrite(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "target.txt").write_bytes(PRECIOUS)
    (tmp_path / "x.png").symlink_to("target.txt")
    error = usage_error(generate, capsys, "--out", "x.png")
    assert "--out 'x.png': is a symbolic link (to 'target.txt'); --overwrite replaces the link itself" in error


@pytest.mark.parametrize("kind", ["stock", "diff"])
def test_compare_checks_its_stock_and_diff_images_too(
    generate: types.ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str
) -> None:
    (tmp_path / f"x_{kind}.png").write_bytes(PRECIOUS)
    generate.parse_args(["--tiny", "--out", "x.png"])  # without --compare only x.png is written
    error = usage_error(generate, capsys, "--out", "x.png", "--compare")
    assert f"--compare's {kind} image 'x_{kind}.png': exists; pass --overwrite" in error
    (tmp_path / f"x_{kind}.png").unlink()
    (tmp_path / f"x_{kind}.png").mkdir()
    error = usage_error(generate, capsys, "--out", "x.png", "--compare", "--overwrite")
    assert f"--compare's {kind} image 'x_{kind}.png': is a directory" in error


def test_the_default_outputs_folder_may_be_missing_and_checks_leave_nothing(
    generate: types.ModuleType, tmp_path: Path
) -> None:
    args = generate.parse_args(["--tiny", "--compare"])
    assert args.out == Path("outputs") / "flux2_pictor.png"
    assert files_in(tmp_path) == []
