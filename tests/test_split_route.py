"""The parity path's fused route (the split prologue, then fp16x3 on its planes) on the CPU: twins and routing.

No GPU here: where a test needs the route, `split_route._selects_split` answers as on an H200 (`select_kernel`
on its facts), and the two steps run their CPU twins (the torch prologue and `split_twin`; `joined_twin` and
the attention twin).

* The split twin: the split kernel's layout, column maxima and scales, 22 bits, v channels of 1e-4..1e4.
* `selects_split_planes` on Hopper and elsewhere (the builds' loading stubbed).
* PictorAttn on a tiny head_dim-128 FLUX.2 (8 text + 67 image tokens, batch 1 and 2, f32 and bf16 weights):
  the fused route where fp16x3 would run, within the twins' 2^-22 of the unfused route; kernels "tf32x3" and
  "f32", precision "bf16" and the KV cache's modes (gap, windows) keep the unfused route.
* torch.compile(fullgraph=True) (aot_eager) through the fused route: no graph break, eager's output.
* The custom ops pass `torch.library.opcheck`; `check_split_planes` refuses inconsistent planes.
"""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_steps

from pictor_diffusers import PictorAttn
from pictor_diffusers.cuda import nvrtc, plan
from pictor_diffusers.cuda.geometry import SplitPlanes
from pictor_diffusers.cuda.plan import selects_split_planes
from pictor_diffusers.cuda.selection import NoKernelError, Problem, select_kernel
from pictor_diffusers.ops import prologue, split_route
from pictor_diffusers.ops.prologue import RmsParams, Segment
from pictor_diffusers.ops.split_reference import joined_twin, split_twin
from pictor_diffusers.ops.validation import check_split_planes
from pictor_diffusers.testing.models import (
    HAS_KV_PROCESSORS,
    TINY_CONFIG,
    build_transformer,
    set_kv_processors,
    transformer_inputs,
)
from pictor_diffusers.testing.references import rel_l2

H200, A100 = ((9, 0), 232448), ((8, 0), 166912)
CONFIG_128 = {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32,) * 4}
TEXT, IMAGE_HW = 8, (1, 67)
"""75 tokens: not a multiple of any tile (64 split rows, 128 query rows, 64 keys)."""
LAYERS = TINY_CONFIG["num_layers"] + TINY_CONFIG["num_single_layers"]
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8}
"""Fused vs unfused twins on the whole model: q, k, v within 2^-22 of the fp16x3 kernel's operands (f32),
then a few bf16 outputs one ulp apart (bf16), carried through four layers."""


@torch.compiler.assume_constant_result
def _on_h200(kernel: str, out_dtype: str, head_dim: int, device_type: str, device_index: int) -> bool:
    """`split_route._selects_split` as an H200 answers it (any device type)."""
    try:
        variant = select_kernel(Problem("float32", out_dtype, head_dim, *H200), kernel).variant
    except NoKernelError:
        return False
    return variant is not None and variant.spec.operands == "split_planes"


def _counting(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Calls of `module.name` from here on, in a one-element list."""
    calls, original = [0], getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _hopper_routes(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Route as on an H200 from here on; returns the counts of (fused, unfused) prologues run."""
    monkeypatch.setattr(split_route, "_selects_split", _on_h200)
    return _counting(monkeypatch, split_route, "_prologue_split"), _counting(monkeypatch, prologue, "_prologue_impl")


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """`_hopper_routes` for the whole test."""
    return _hopper_routes(monkeypatch)


def _qkv(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 3, seq, 128, generator=generator) for _ in range(3))
    return q, k, v * torch.logspace(-4, 4, 128)


@pytest.mark.parametrize("batch", [1, 2])
def test_split_twin_layout_scales_and_22_bits(batch: int) -> None:
    q, k, v = _qkv(batch, TEXT + IMAGE_HW[1], seed=batch)
    split = split_twin(q, k, v)
    groups, seq = batch * 3, q.shape[2]
    planes = split.planes.view(3, 2, groups, seq, 128)
    assert split.shape == q.shape and split.colmax.shape == (3, groups, 128)
    for index, tensor in enumerate((q, k, v)):
        columns = tensor.reshape(groups, seq, 128)
        assert torch.equal(split.colmax[index].view(torch.float32), columns.abs().amax(dim=1))
        largest = columns.abs().amax(dim=1) if index == 2 else columns.abs().amax(dim=(1, 2))[:, None]
        scale = torch.exp2(14 - torch.floor(torch.log2(largest))).double()[:, None, :]
        scaled = columns.double() * scale
        peak = scaled.abs().amax(dim=1) if index == 2 else scaled.abs().amax(dim=(1, 2))
        assert ((peak >= 2**14) & (peak < 2**15)).all(), f"tensor {index}: a group's largest value is off scale"
        joined = planes[index, 0].double() + planes[index, 1].double()
        assert ((joined - scaled).abs() <= 2.0**-22 * scaled.abs() + 2.0**-25).all(), f"tensor {index}"
    for index, (ours, exact) in enumerate(zip(joined_twin(split), (q, k, v), strict=True)):
        largest = exact.abs().amax(dim=2, keepdim=True) if index == 2 else exact.abs().amax(dim=(2, 3), keepdim=True)
        assert ((ours - exact).abs() <= 2.0**-21 * largest).all(), f"tensor {index} joined"


def test_selects_split_planes_only_where_fp16x3_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    facts = {0: H200, 1: A100}
    monkeypatch.setattr(nvrtc, "device_facts", lambda index: facts[index])
    monkeypatch.setattr(nvrtc, "function", lambda variant, index: 1)
    monkeypatch.setattr(plan, "_resolved", {})
    monkeypatch.setattr(plan, "_disabled", {})
    f32, bf16 = torch.float32, torch.bfloat16
    assert selects_split_planes("auto", f32, 128, 0) and selects_split_planes("auto", bf16, 128, 0)
    assert selects_split_planes("fp16x3", f32, 128, 0)
    for kernel, head_dim, device in (("tf32x3", 128, 0), ("f32", 128, 0), ("auto", 64, 0), ("fp16x3", 64, 0),
                                     ("auto", 128, 1), ("fp16x3", 128, 1)):  # fmt: skip
        assert not selects_split_planes(kernel, f32, head_dim, device), (kernel, head_dim, device)


def test_the_cpu_and_other_norms_take_the_unfused_route() -> None:
    projections = [torch.randn(1, 5, 256) for _ in range(3)]
    rms = RmsParams(None, 1e-6)
    assert not split_route.takes_split_route([Segment(*projections, rms, rms)], 128, "auto", torch.float32)
    layer_norm = torch.nn.LayerNorm(128)
    assert not split_route.takes_split_route([Segment(*projections, layer_norm, rms)], 128, "fp16x3", torch.float32)


def _model_and_inputs(dtype: torch.dtype, batch: int) -> tuple[torch.nn.Module, dict]:
    model = build_transformer(CONFIG_128, dtype=dtype)
    return model, transformer_inputs(model, batch, IMAGE_HW, TEXT)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_route_is_taken_and_matches_the_unfused_route(
    batch: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = _model_and_inputs(dtype, batch)
    model.set_attn_processor(PictorAttn())
    unfused = model(**inputs)[0]
    fused_calls, unfused_calls = routes = _hopper_routes(monkeypatch)
    fused = model(**inputs)[0]
    assert (fused_calls[0], unfused_calls[0]) == (LAYERS, 0), routes
    assert fused.dtype == dtype and torch.isfinite(fused).all()
    assert rel_l2(fused, unfused) <= TOLERANCE[dtype]


@torch.no_grad()
@pytest.mark.parametrize(("kernel", "precision"), [("tf32x3", "fp32"), ("f32", "fp32"), ("auto", "bf16")])
def test_other_kernels_keep_the_unfused_route(kernel: str, precision: str, hopper: tuple) -> None:
    model, inputs = _model_and_inputs(torch.float32, 1)
    model.set_attn_processor(PictorAttn(kernel=kernel, precision=precision))
    model(**inputs)
    assert (hopper[0][0], hopper[1][0]) == (0, LAYERS)


@pytest.mark.skipif(not HAS_KV_PROCESSORS, reason="this diffusers has no FLUX.2-klein KV processors")
@torch.no_grad()
def test_kv_cache_modes_keep_the_unfused_route(hopper: tuple) -> None:
    """The extract step's windows and the cached step's gap in k and v: unfused, with the stock results."""
    model = build_transformer(CONFIG_128, seed=0)
    set_kv_processors(model)
    stock_extract, stock_cached, _ = kv_steps(model, 2)
    model.set_attn_processor(PictorAttn())
    extract, cached, _ = kv_steps(model, 2)
    assert (hopper[0][0], hopper[1][0]) == (0, 2 * LAYERS), "a KV-cache step took the fused route"
    assert rel_l2(extract, stock_extract) <= 1e-5 and rel_l2(cached, stock_cached) <= 1e-5
    model(**transformer_inputs(model, 1, IMAGE_HW, TEXT))
    assert hopper[0][0] == LAYERS, "a plain step after them did not take the fused route"


@torch.no_grad()
def test_compiled_fused_route_has_no_graph_break(hopper: tuple) -> None:
    model, inputs = _model_and_inputs(torch.float32, 2)
    model.set_attn_processor(PictorAttn())
    eager = model(**inputs)[0]
    try:
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)[0]
    finally:
        torch._dynamo.reset()
    assert (hopper[0][0], hopper[1][0]) == (2 * LAYERS, 0), "the compiled model left the fused route"
    assert torch.equal(compiled, eager)


def _op_inputs(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[float]]:
    generator = torch.Generator().manual_seed(5)
    projections = [torch.randn(2, n, 256, generator=generator).to(dtype) for n in (TEXT, TEXT, TEXT, 67, 67, 67)]
    weights = [torch.rand(128, generator=generator) + 0.5 for _ in range(4)]
    angles = torch.rand(TEXT + 67, 64, generator=generator) * 6.3
    rope = [angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)]
    return projections, weights, rope, [1e-6] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_custom_ops_pass_opcheck(dtype: torch.dtype) -> None:
    args = _op_inputs(dtype)
    planes, colmax = torch.ops.pictor.qkv_prologue_split(*args)
    reference = split_twin(*prologue.pack_head_major_torch(*args))
    assert torch.equal(planes, reference.planes) and torch.equal(colmax, reference.colmax)
    torch.library.opcheck(torch.ops.pictor.qkv_prologue_split.default, args)
    attention_args = (planes, colmax, 2, TEXT + 67, 128**-0.5, "auto", "float32")
    torch.library.opcheck(torch.ops.pictor.attention_split.default, attention_args)


def test_inconsistent_planes_are_refused() -> None:
    split = split_twin(*_qkv(1, 10, seed=3))
    check_split_planes(split)
    for bad, match in (
        (split._replace(heads=2), "multiple of heads"),
        (split._replace(seq=11), "hold"),
        (split._replace(planes=split.planes[1:]), "hold"),
        (split._replace(colmax=split.colmax.float()), "int32"),
    ):
        with pytest.raises((TypeError, ValueError), match=match):
            check_split_planes(SplitPlanes(*bad))
