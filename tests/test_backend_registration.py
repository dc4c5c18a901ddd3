"""Registering pictor's backends with diffusers' dispatcher, on CPU.

* the real diffusers: enum members, registry rows, context parallelism declared, idempotent;
* feature detection of diffusers' private layout on fakes: unknown layouts warn and change nothing,
  a well-formed layout (`register` with and without the context-parallel flag) gets served backends;
* DIFFUSERS_ATTN_BACKEND naming a pictor backend, in a fresh process.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from diffusers.models import attention_dispatch as dispatch
from diffusers.models.attention_dispatch import AttentionBackendName
from test_backend import NAMES, qkv, sdpa64
from test_flux1 import rel_l2

import pictor_diffusers.integration.dispatcher_call as dispatcher_call
from pictor_diffusers import register_backends

Registry = dispatch._AttentionBackendRegistry


def test_registered_backends() -> None:
    for name in NAMES:
        member = AttentionBackendName(name)
        assert member.value == name and AttentionBackendName[name.upper()] is member and member in AttentionBackendName
        assert Registry._backends[member]._pictor_backend == name
        assert Registry._supported_arg_names[member] == Registry._supported_arg_names[AttentionBackendName.NATIVE]
        assert Registry._is_context_parallel_available(member)
    size, functions = len(AttentionBackendName), [Registry._backends[AttentionBackendName(n)] for n in NAMES]
    assert register_backends() == tuple(NAMES)
    assert len(AttentionBackendName) == size
    assert functions == [Registry._backends[AttentionBackendName(n)] for n in NAMES]


def fake_names(*members: str) -> type[enum.Enum]:
    return enum.Enum("AttentionBackendName", {m.upper(): m for m in members}, type=str)


def fake_registry(names: type[enum.Enum], takes_cp_flag: bool = True, native: bool = True) -> type:
    """A registry shaped like diffusers' (`register` of 0.36+ with `takes_cp_flag`, of 0.35 without)."""
    registry = type("Registry", (), {"_backends": {}, "_constraints": {}, "_supported_arg_names": {}})
    registry._active_backend = names("native")

    def add(backend: enum.Enum, constraints: list | None, func: object) -> object:
        registry._backends[backend], registry._constraints[backend] = func, constraints or []
        registry._supported_arg_names[backend] = dispatcher_call.parameters(func)
        return func

    def register(backend: enum.Enum, constraints: list | None = None, supports_context_parallel: bool = False):
        return lambda func: add(backend, constraints, func)

    def register_035(backend: enum.Enum, constraints: list | None = None):
        return lambda func: add(backend, constraints, func)

    registry.register = staticmethod(register if takes_cp_flag else register_035)
    if native:
        registry.register(names("native"))(lambda query, key, value, attn_mask=None, **_: value)
    return registry


def unknown_layout(kind: str) -> types.SimpleNamespace:
    """A dispatcher module missing one piece of the private layout pictor relies on."""
    names = fake_names("native")
    layouts = {
        "empty module": {},
        "plain enum": {"AttentionBackendName": enum.Enum("N", {"NATIVE": "native"})},
        "no native member": {"AttentionBackendName": fake_names("flash")},
        "no registry": {"AttentionBackendName": names},
        "no tables": {"AttentionBackendName": names, "_AttentionBackendRegistry": type("R", (), {})},
        "no native backend": {
            "AttentionBackendName": names,
            "_AttentionBackendRegistry": fake_registry(names, native=False),
        },
    }
    return types.SimpleNamespace(**layouts[kind])


UNKNOWN_LAYOUTS = {
    "empty module": "no str Enum",
    "plain enum": "no str Enum",
    "no native member": "a native member",
    "no registry": "no _AttentionBackendRegistry",
    "no tables": "lacks the tables",
    "no native backend": "no native backend",
}


@pytest.mark.parametrize(("layout", "problem"), UNKNOWN_LAYOUTS.items(), ids=list(UNKNOWN_LAYOUTS))
def test_unknown_layout_warns_and_changes_nothing(layout: str, problem: str) -> None:
    fake = unknown_layout(layout)
    names = getattr(fake, "AttentionBackendName", [])
    size, real_size = len(names), len(AttentionBackendName)
    with pytest.warns(RuntimeWarning, match="unknown layout") as caught:
        assert register_backends(fake) == ()
    assert problem in str(caught[0].message)
    assert len(names) == size and len(AttentionBackendName) == real_size


@pytest.mark.parametrize("takes_cp_flag", [True, False], ids=["0.36+", "0.35-register"])
def test_registers_on_a_well_formed_fake(takes_cp_flag: bool) -> None:
    names = fake_names("native", "flash")
    fake = types.SimpleNamespace(
        AttentionBackendName=names, _AttentionBackendRegistry=fake_registry(names, takes_cp_flag)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert register_backends(fake) == tuple(NAMES)
    assert [m.value for m in names] == ["native", "flash", *NAMES]
    query, key, value = qkv((1, 6, 2, 8))
    served = fake._AttentionBackendRegistry._backends[names("pictor")](query, key, value)
    assert rel_l2(served, sdpa64(query, key, value)) <= 1e-5
    with pytest.warns(RuntimeWarning, match="attn_mask"):
        assert fake._AttentionBackendRegistry._backends[names("pictor_bf16")](query, key, value, query) is value


@pytest.mark.parametrize("env", ["pictor_bf16", "_native_math"])
def test_diffusers_attn_backend_env(env: str) -> None:
    """A pictor name becomes the active backend; diffusers' own names stay as diffusers set them."""
    root = Path(__file__).resolve().parents[1]
    script = (
        "import pictor_diffusers\n"
        "from diffusers import FluxTransformer2DModel\n"
        "from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R\n"
        "print(R._active_backend.value)\n"
    )
    environment = {
        **os.environ,
        "DIFFUSERS_ATTN_BACKEND": env,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == env
