"""The diffusers-suite runner (`tests/diffusers_suite/run_diffusers_tests.py`) loaded as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

RUNNER = Path(__file__).parent / "diffusers_suite" / "run_diffusers_tests.py"


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_diffusers_tests", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
