"""Shared by the SD3 and CogVideoX tests: run a model with a processor, count PictorAttn's attentions, measure both
processors against a float64 run of the stock model, and compile."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from diffusers.models.attention_processor import Attention

from pictor_diffusers import PictorAttn
from pictor_diffusers.testing.references import rel_l2


def attention_modules(model: torch.nn.Module) -> int:
    """How many attention modules `model` has (one processor each)."""
    return len(model.attn_processors)


@contextmanager
def count_pictor_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count `PictorAttn._attend` runs (prologue + attention, once per module call)."""
    calls = [0]
    original = PictorAttn._attend

    def counting(self: PictorAttn, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(PictorAttn, "_attend", counting)
        yield calls


def run(model: torch.nn.Module, inputs: dict, processor: Any) -> torch.Tensor:
    """`model`'s first output with `processor` set on every attention module."""
    with torch.no_grad():
        model.set_attn_processor(processor)
        return model(**inputs)[0]


def run_pictor(
    model: torch.nn.Module, inputs: dict, processor: PictorAttn, monkeypatch: pytest.MonkeyPatch
) -> torch.Tensor:
    """`run` with `processor`, asserting that pictor served every attention module once."""
    with count_pictor_calls(monkeypatch) as calls:
        out = run(model, inputs, processor)
    assert all(isinstance(p, PictorAttn) for p in model.attn_processors.values())
    assert calls[0] == attention_modules(model), f"pictor ran {calls[0]} of {attention_modules(model)} attentions"
    return out


def cast_inputs(inputs: dict, dtype: torch.dtype) -> dict:
    """Floating-point tensor inputs in `dtype`; RoPE tables (float32, as the pipelines make them) as they are."""
    return {
        name: value.to(dtype)
        if name != "image_rotary_emb" and isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in inputs.items()
    }


def float64_reference(model: torch.nn.Module, inputs: dict, stock: Any) -> torch.Tensor:
    """The stock processor on a float64 copy of `model` (RoPE tables in float64 too)."""
    reference = copy.deepcopy(model).double()
    inputs = cast_inputs(inputs, torch.float64)
    if "image_rotary_emb" in inputs:
        inputs["image_rotary_emb"] = tuple(t.double() for t in inputs["image_rotary_emb"])
    return run(reference, inputs, stock)


def errors(stock: torch.Tensor, pictor: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(stock's, pictor's) relative L2 error against `reference`, after checking shapes, dtypes, finiteness."""
    assert pictor.shape == stock.shape and pictor.dtype == stock.dtype
    assert torch.isfinite(stock).all() and torch.isfinite(pictor).all()
    return rel_l2(stock, reference), rel_l2(pictor, reference)


def fuse_with_stale_projections(model: torch.nn.Module) -> None:
    """`fuse_qkv_projections()`, then the separate projections x2: a processor that reads them disagrees."""
    model.fuse_qkv_projections()
    with torch.no_grad():
        for attn in (m for m in model.modules() if isinstance(m, Attention)):
            assert attn.fused_projections
            for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                if getattr(attn, name, None) is not None:
                    getattr(attn, name).weight.mul_(2.0)


def assert_float32_parity(
    model: torch.nn.Module, inputs: dict, stock: Any, monkeypatch: pytest.MonkeyPatch, fuse: Callable | None = None
) -> None:
    """PictorAttn within 1e-5 relative L2 of `stock` and within 1.5x stock's error against float64; `fuse(model)`
    runs after the stock run (stock's fused processors are not the reference: SD3's skips the QK norms)."""
    reference = float64_reference(model, inputs, stock)
    stock_out = run(model, inputs, stock)
    if fuse is not None:
        fuse(model)
    pictor = run_pictor(model, inputs, PictorAttn(), monkeypatch)
    stock_error, pictor_error = errors(stock_out, pictor, reference)
    assert rel_l2(pictor, stock_out) <= 1e-5
    assert pictor_error <= 1.5 * stock_error, f"rel L2 {pictor_error:.3e} > 1.5 x stock's {stock_error:.3e}"


def assert_low_precision(
    model: torch.nn.Module,
    make_inputs: Callable[[torch.nn.Module], dict],
    stock: Any,
    dtype: torch.dtype,
    precision: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`model` cast to `dtype`: PictorAttn(precision) within 1.25x stock's error against the float64 run."""
    reference = float64_reference(model, make_inputs(model), stock)
    model = model.to(dtype)
    inputs = make_inputs(model)
    stock_out = run(model, inputs, stock)
    pictor = run_pictor(model, inputs, PictorAttn(precision=precision), monkeypatch)
    stock_error, pictor_error = errors(stock_out, pictor, reference)
    assert pictor_error <= 1.25 * stock_error, f"rel L2 {pictor_error:.3e} > 1.25 x stock's {stock_error:.3e}"


def assert_compiles_to_eager(model: torch.nn.Module, inputs: dict) -> None:
    """`torch.compile(fullgraph=True)` (aot_eager: dynamo and the fakes, no code generation) with PictorAttn set
    gives eager's output exactly."""
    model.set_attn_processor(PictorAttn())
    try:
        with torch.no_grad():
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)[0]
    finally:
        torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(compiled, model(**inputs)[0])
