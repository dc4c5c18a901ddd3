"""benchmarks/bench_layers.py's layers on CPU, tiny: each one call on native, on float64 attention and on every
pictor backend the bench times.

Every pictor call is served (pictor's attention runs, no fallback warning); each output is as accurate against
the float64-attention reference as native's (1.5x native's error + 4e-3, the backend tests' bf16 bound); the
float64 reference differs from native (the reference is not native run again).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from test_backend import pictor_warnings
from test_flux1 import count_pictor_calls

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_layers
from layer_cases import BACKENDS, errors, layer_outputs, layers

LAYERS = layers("cpu", tiny=True, wan_tokens=24)


def test_bench_layers_documents_every_layer() -> None:
    assert set(LAYERS) == {"wan-self", "wan-cross", "qwen-masked", "ltx-block", "sd35-joint", "hunyuan-block",
                           "flux1-dev"}  # fmt: skip
    assert all(f"`{name}`" in bench_layers.__doc__ for name in LAYERS)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_served_and_accurate(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = LAYERS[name]()
    with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = layer_outputs(layer, BACKENDS)
    assert calls[0] >= len(BACKENDS) and not pictor_warnings(caught), pictor_warnings(caught)
    row = errors(outputs)
    native = row["native_rel_l2_vs_float64"]
    assert 0 < native < 2e-2, f"{name}: native {native:.3e} against float64"
    for backend in BACKENDS:
        assert outputs[backend].shape == outputs["native"].shape
        error = row[f"{backend}_rel_l2_vs_float64"]
        assert error <= 1.5 * native + 4e-3, f"{name} {backend}: {error:.3e} (native {native:.3e})"
