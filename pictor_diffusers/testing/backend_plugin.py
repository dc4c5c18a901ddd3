"""pytest plugin: diffusers' own tests with a pictor attention backend active, for the models on the dispatcher.

    pytest -p pictor_diffusers.testing.backend_plugin tests/models/transformers/test_models_transformer_ltx.py

(run from a checkout of diffusers' tests; `tests/diffusers_suite/run_diffusers_tests.py --model ltx` runs them with
and without it and compares). `PICTOR_DIFFUSERS_BACKEND` names the backend, default "pictor" (the parity
contract; "pictor_bf16" and "pictor_fp16" round q, k, v to 16 bits, which diffusers' float32 tolerances were not
written for).

Every test runs inside `attention_backend(<name>)`, so each `dispatch_attention_fn` call that names no backend
(the default of every processor on the dispatcher: FLUX.1, FLUX.2's stock processors, Qwen-Image, Wan,
HunyuanVideo, LTX, ...) goes to pictor; a test that sets a backend itself keeps it. Nothing is hidden: pictor's
errors propagate and its fallbacks to diffusers' native backend happen as in use. Each test's report carries
(junit `<properties>`): `pictor_attn_calls`, the calls pictor's kernels served; `fallback_calls`, the calls
that fell back to native attention, and `fallback_reasons`, their reasons (comma-separated).
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any

import pytest
from diffusers.models.attention_dispatch import attention_backend

import pictor_diffusers  # registers the backends
from pictor_diffusers.integration import dispatcher_call

BACKEND_ENV = "PICTOR_DIFFUSERS_BACKEND"
_FALLBACK = "run diffusers' native attention instead"
"""What the backend's fallback warning says (`dispatcher_call.make_backend`), whatever its reason."""
_counts: dict[str, Any] = {"pictor_attn_calls": 0, "fallbacks": Counter()}
_originals: dict[str, Any] = {}


def backend_name() -> str:
    return os.environ.get(BACKEND_ENV, "pictor")


def install() -> None:
    """Count the backend's served calls and its fallbacks (idempotent)."""
    if _originals:
        return
    serve, warn = dispatcher_call._serve, dispatcher_call.warn_once

    @functools.wraps(serve)
    def counted_serve(*args: Any, **kwargs: Any) -> Any:
        _counts["pictor_attn_calls"] += 1
        return serve(*args, **kwargs)

    @functools.wraps(warn)
    def counted_warn(key: str, message: str, stacklevel: int = 3) -> None:
        if _FALLBACK in message:
            _counts["fallbacks"][key] += 1
        warn(key, message, stacklevel + 1)

    _originals.update(_serve=serve, warn_once=warn)
    dispatcher_call._serve, dispatcher_call.warn_once = counted_serve, counted_warn


def uninstall() -> None:
    for name, original in _originals.items():
        setattr(dispatcher_call, name, original)
    _originals.clear()


def pytest_configure(config: pytest.Config) -> None:
    assert pictor_diffusers  # imported for its registration
    with attention_backend(backend_name()):  # an unknown name fails here, once, not in every test
        pass
    install()


def pytest_unconfigure(config: pytest.Config) -> None:
    uninstall()


def pytest_report_header(config: pytest.Config) -> str:
    return f"pictor_diffusers backend plugin: attention_backend({backend_name()!r}) around every test"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _counts["pictor_attn_calls"] = 0
    _counts["fallbacks"] = Counter()
    with attention_backend(backend_name()):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "teardown":
        fallbacks = _counts["fallbacks"]
        item.user_properties.extend((
            ("pictor_attn_calls", _counts["pictor_attn_calls"]),
            ("fallback_calls", sum(fallbacks.values())),
            ("fallback_reasons", ",".join(sorted(fallbacks))),
        ))  # fmt: skip
        report.user_properties = list(item.user_properties)
    return report
