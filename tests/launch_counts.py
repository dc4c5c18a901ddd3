"""Count attention-kernel launches of one registry family, for tests that must prove which kernel ran."""

from __future__ import annotations

import pytest

from pictor_diffusers.cuda import launch


def count_launches(monkeypatch: pytest.MonkeyPatch, family: str) -> list[int]:
    """Launches of `family` kernels ("16bit", "8bit", ...) from here on, in a one-element list."""
    calls = [0]
    original = launch.launch_attention

    def counting(plan: launch.AttentionPlan, written: object = None) -> None:
        calls[0] += plan.selection.variant.spec.family == family
        original(plan, written)

    monkeypatch.setattr(launch, "launch_attention", counting)
    return calls
