"""examples/generate.py's command line: each input check stops with a message naming the value; --help shows defaults.

The checks run in-process on `parse_args`, so each test fails if its check is removed.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the FLUX.2 pipelines import transformers (extra: examples)")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "generate.py"


@pytest.fixture(scope="module")
def generate() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("generate_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(generate: types.ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error that `parse_args(argv)` stops with (exit status 2, argparse's usage error)."""
    with pytest.raises(SystemExit) as stopped:
        generate.parse_args(["--tiny", *argv])
    assert stopped.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


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
