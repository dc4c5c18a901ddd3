"""Shared pytest fixtures and markers: GPU tests skip cleanly without CUDA; one closing line says why tests skipped."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def restore_diffusers_active_backend() -> Iterator[None]:
    """`model.set_attention_backend(name)` also sets diffusers' process-wide active backend: put it back after each
    test, or every later stock reference would run through whatever backend a test chose last."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry
    except ImportError:
        yield
        return
    active = registry._active_backend
    try:
        yield
    finally:
        registry._active_backend = active


@pytest.fixture(autouse=True)
def forget_one_time_warnings() -> None:
    """pictor warns once per reason per process (backend fallbacks, unknown diffusers layouts): start each
    test with none given, so each test sees the warnings it causes."""
    from pictor_diffusers.integration import dispatcher_call

    dispatcher_call._WARNED.clear()


Report = pytest.TestReport | pytest.CollectReport


def skip_reason(report: Report) -> str:
    """The reason a test skipped, without pytest's "Skipped: " prefix, on one line."""
    longrepr = report.longrepr
    reason = (longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)).strip()
    return reason.removeprefix("Skipped: ").splitlines()[0] if reason else "no reason given"


def skip_summary(reports: list[Report]) -> str:
    """'204 skipped: needs a CUDA device (200), needs ptxas (4)': the skips grouped by reason, most first."""
    counts = Counter(skip_reason(report) for report in reports)
    by_count = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    grouped = ", ".join(f"{reason} ({count})" for reason, count in by_count)
    return f"{len(reports)} skipped: {grouped}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    reports = terminalreporter.stats.get("skipped", [])
    skipped = [report for report in reports if getattr(report, "count_towards_summary", True)]
    if skipped:
        terminalreporter.write_line(skip_summary(skipped))
