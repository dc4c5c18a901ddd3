"""examples/generate.py --tiny runs end to end on the CPU: denoising loop, PNGs in outputs/, comparison, quiet."""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
from generate_script import load_generate, run_script

pytest.importorskip("transformers", reason="the FLUX.2 pipelines import transformers (extra: examples)")

DIFFUSERS_NOISE = ("should be kept in float32", "is ignored for step-wise distilled models")


def test_tiny_generation_with_compare_writes_only_to_outputs(tmp_path: Path) -> None:
    result = run_script("--tiny", "--steps", "2", "--height", "128", "--width", "128", "--compare", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "runs its pure-torch reference" in lines[0] and "say nothing about its speed on a GPU" in lines[0]
    assert "RANDOM weights" in result.stdout
    assert "after a warm-up step" in result.stdout
    assert "CPU timings also swing" in lines[-1]
    compared = [line for line in lines if line.startswith(("PictorAttn vs stock:", "yardstick"))]
    assert len(compared) == 2
    for line in compared:
        assert re.search(r": [\d,]+ of 49,152 values differ", line), line
        assert "PSNR" in line or "identical" in line
    assert "stretched" in result.stdout and "full brightness" in result.stdout
    assert [path.name for path in tmp_path.iterdir()] == ["outputs"]
    outputs = tmp_path / "outputs"
    names = ("flux2_pictor.png", "flux2_pictor_stock.png", "flux2_pictor_diff.png")
    assert sorted(path.name for path in outputs.iterdir()) == sorted(names)
    for name in names:
        assert (outputs / name).stat().st_size > 0
    for noise in DIFFUSERS_NOISE:
        assert noise not in result.stdout + result.stderr
    for label in ("pictor fp32", "stock", "stock, SDPA math"):
        assert f"{label}: 100%" in result.stderr, f"no progress bar labelled {label!r}"


def test_verbose_shows_diffusers_logs_and_a_named_out_path_is_used(tmp_path: Path) -> None:
    (tmp_path / "named").mkdir()
    result = run_script(
        "--tiny", "--steps", "1", "--height", "32", "--width", "32", "--verbose", "--out", "named/x.png", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "is ignored for step-wise distilled models" not in result.stderr, "default guidance is wrong for klein"
    assert "warm-up included" in result.stdout
    assert [path.name for path in tmp_path.iterdir()] == ["named"]
    assert (tmp_path / "named" / "x.png").stat().st_size > 0


@pytest.mark.parametrize("model", ["black-forest-labs/FLUX.2-klein-4B", "/nonexistent/flux2-dir"])
def test_missing_weights_give_a_clear_message(model: str, tmp_path: Path) -> None:
    result = run_script("--model", model, "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert "Could not load FLUX.2 weights" in result.stderr
    assert "--tiny" in result.stderr


def test_quiet_silences_library_logs_unless_verbose() -> None:
    """`--verbose` leaves diffusers' and transformers' log levels alone; without it they log errors only.
    (Checked on the loggers: which messages a tiny run prints differs between diffusers versions.)"""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    generate = load_generate()
    levels = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()
    with warnings.catch_warnings():
        try:
            diffusers_logging.set_verbosity_warning()
            transformers_logging.set_verbosity_warning()
            generate.quiet(True)
            assert diffusers_logging.get_verbosity() == transformers_logging.get_verbosity() == logging.WARNING
            generate.quiet(False)
            assert diffusers_logging.get_verbosity() == transformers_logging.get_verbosity() == logging.ERROR
        finally:
            diffusers_logging.set_verbosity(levels[0])
            transformers_logging.set_verbosity(levels[1])
