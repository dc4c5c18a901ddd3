"""Helpers for the tests of examples/generate.py: load it as a module, read its usage errors, run it on the CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "generate.py"
PRECIOUS = b"not an image: must survive every run"


def load_generate() -> types.ModuleType:
    """examples/generate.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("generate_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(generate: types.ModuleType, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error that `parse_args(["--tiny", *argv])` stops with (exit status 2, argparse's usage error)."""
    with pytest.raises(SystemExit) as stopped:
        generate.parse_args(["--tiny", *argv])
    assert stopped.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def run_script(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """generate.py in a fresh interpreter on the CPU, offline, with the checkout's package importable."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300, cwd=cwd
    )


def files_in(folder: Path) -> list[str]:
    """The names in `folder`, sorted."""
    return sorted(path.name for path in folder.iterdir())
