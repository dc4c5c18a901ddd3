"""The diffusers-suite tools for the models on diffusers' dispatcher (CPU): the pytest plugin that runs diffusers'
own tests with a pictor backend active and counts what it served and what fell back, and the runner's choice of
plugin and its fallback summary (`tests/diffusers_suite`)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from suite_runner import load_runner

from pictor_diffusers.integration import dispatcher_call
from pictor_diffusers.testing import backend_plugin


@pytest.fixture
def plugin():
    originals = dispatcher_call._serve, dispatcher_call.warn_once
    backend_plugin.install()
    yield backend_plugin
    backend_plugin.uninstall()
    assert (dispatcher_call._serve, dispatcher_call.warn_once) == originals, "uninstall restores the module"


@pytest.mark.parametrize("seq_k", [24, 37])
def test_plugin_counts_served_calls_and_fallbacks(plugin, seq_k: int) -> None:
    """Calls the backend serves are counted, and each fallback to native attention under its reason (a warning
    deduplicated per process still counts every call); the results are the calls' own."""
    generator = torch.Generator().manual_seed(seq_k)
    query = torch.randn(2, 20, 3, 16, generator=generator)
    key, value = (torch.randn(2, seq_k, 3, 16, generator=generator) for _ in "kv")
    plugin._counts["pictor_attn_calls"], plugin._counts["fallbacks"] = 0, type(plugin._counts["fallbacks"])()
    with attention_backend(plugin.backend_name()), pytest.warns(RuntimeWarning, match="native attention"):
        served = dispatch_attention_fn(query, key, value)
        causal = [dispatch_attention_fn(query, key, value, is_causal=True) for _ in range(2)]
    assert plugin._counts["pictor_attn_calls"] == 1
    assert dict(plugin._counts["fallbacks"]) == {"is_causal": 2}
    native = dispatch_attention_fn(query, key, value, is_causal=True, backend="native")
    assert all(torch.equal(out, native) for out in causal)
    torch.testing.assert_close(served, dispatch_attention_fn(query, key, value, backend="native"))


def test_runner_summarises_fallbacks() -> None:
    runner = load_runner()

    def case(calls: int, fallbacks: int, reasons: str) -> dict:
        properties = {"pictor_attn_calls": str(calls), "fallback_calls": str(fallbacks), "fallback_reasons": reasons}
        return {"outcome": "passed", "message": "", "properties": properties}

    pictor = {"a::T::x": case(3, 0, ""), "a::TestTraining::y": case(0, 4, "autograd"), "a::T::z": case(1, 2, "a,b")}
    result = runner.compare({t: {"outcome": "passed"} for t in pictor}, pictor)
    assert result["fallback_calls"] == 6 and result["tests_with_fallbacks"] == ["a::T::z", "a::TestTraining::y"]
    assert result["fallback_reasons"] == {"autograd": 1, "a": 1, "b": 1}


@pytest.mark.parametrize(
    ("model", "via", "plugin"),
    [("ltx", None, "backend"), ("wan", None, "backend"), ("sd3", None, "processor"), ("flux2", "backend", "backend")],
)
def test_runner_picks_the_plugin(tmp_path, monkeypatch, capsys, model: str, via: str | None, plugin: str) -> None:
    """The second run puts pictor in through the backend for the models on the dispatcher, through the processor
    for FLUX.2, SD3 and CogVideoX, unless `--via` says otherwise; the first run has no pictor plugin."""
    runner = load_runner()
    for target in runner.TARGETS[model]:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / target).touch()
    runs = []

    def run_pytest(root, junit, plugin_name, precision, backend, targets, extra) -> int:
        runs.append((plugin_name, backend, targets))
        junit.write_text('<testsuite><testcase classname="a.T" name="x"/></testsuite>')
        return 0

    monkeypatch.setattr(runner, "run_pytest", run_pytest)
    argv = ["--diffusers-tests", str(tmp_path), "--model", model, "--backend", "pictor_bf16"]
    assert runner.main(argv + (["--via", via] if via else [])) == 0
    assert [r[0] for r in runs] == [None, runner.VIA[plugin]]
    assert runs[1][1:] == ("pictor_bf16", runner.TARGETS[model])
    assert f'"via": "{plugin}"' in capsys.readouterr().out
