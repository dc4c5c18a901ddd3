"""examples/generate.py --tiny runs end to end on the CPU: denoising loop, PNGs, comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the FLUX.2 pipelines import transformers (extra: examples)")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "generate.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_tiny_generation_with_compare(tmp_path: Path) -> None:
    out = tmp_path / "img.png"
    result = _run("--tiny", "--steps", "2", "--height", "128", "--width", "128", "--compare", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stdout
    assert "PSNR" in result.stdout
    for name in ("img.png", "img_stock.png", "img_diff.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("model", ["black-forest-labs/FLUX.2-klein-4B", "/nonexistent/flux2-dir"])
def test_missing_weights_give_a_clear_message(model: str, tmp_path: Path) -> None:
    result = _run("--model", model, "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert result.returncode != 0
    assert "Could not load FLUX.2 weights" in result.stderr
    assert "--tiny" in result.stderr
