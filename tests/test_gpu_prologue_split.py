"""The split prologue (`kernels/qkv_prologue_split.cu`) and the parity path's fused route, on Hopper.

* Planes and column maxima bit for bit those of the prologue (float32 out) followed by the split kernel, and
  of the split's torch twin on the same values: separate and fused projections, one and two segments,
  8 text + 67 image tokens (no tile multiple), batch 1 and 2, f32 / bf16 / f16 projections, with and
  without RoPE; the planes are poisoned with NaN before every launch.
* v channels of 1e-4..1e4: bit-identical planes, and attention on them within 1e-5 of each channel's
  magnitude of float64.
* PictorAttn on a tiny head_dim-128 FLUX.2: the fused route (split prologue launched, split prepass never;
  its attention replayed by the plan memo across layers) gives the unfused route's output bit for bit, and
  f32 models land within 1e-5 of float64 stock; under torch.compile the route holds; the KV cache's modes and
  public `attention()` keep the unfused route.
"""

from __future__ import annotations

import pytest
import torch
from kv_helpers import kv_steps
from launch_counts import count_launches

from pictor_diffusers import PictorAttn
from pictor_diffusers.cuda import nvrtc, runtime
from pictor_diffusers.cuda.geometry import SplitPlanes, split_halves
from pictor_diffusers.cuda.launch import qkv_prologue_cuda, qkv_prologue_split_cuda, split_qkv_cuda
from pictor_diffusers.cuda.pass_rows import split_variant
from pictor_diffusers.cuda.prologue_layout import prologue_layout
from pictor_diffusers.ops import split_route
from pictor_diffusers.ops.attention import attention
from pictor_diffusers.ops.split_reference import split_twin
from pictor_diffusers.testing.models import TINY_CONFIG, build_transformer, set_kv_processors, transformer_inputs
from pictor_diffusers.testing.references import attention_float64, rel_l2

pytestmark = pytest.mark.gpu


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the fp16x3 kernel needs an sm_90 GPU (H100/H200)")

HEADS, HEAD_DIM, TEXT, IMAGE = 3, 128, 8, 67
INNER = HEADS * HEAD_DIM
CONFIG_128 = {**TINY_CONFIG, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (32,) * 4}
LAYERS = TINY_CONFIG["num_layers"] + TINY_CONFIG["num_single_layers"]
V_CHANNELS = torch.logspace(-4, 4, HEAD_DIM).repeat(HEADS)
"""Per-channel magnitudes of v, 1e-4..1e4 in every head."""


def _separate(batch: int, tokens: int, dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v = (torch.randn(batch, tokens, INNER, device="cuda") for _ in range(3))
    return [q.to(dtype), k.to(dtype), (v * V_CHANNELS.cuda()).to(dtype)]


def _fused(batch: int, tokens: int, dtype: torch.dtype, extra: int = 0) -> list[torch.Tensor]:
    """Chunks of one `[B, n, 3*inner + extra]` projection, as fused and single-stream layers give."""
    fused = torch.randn(batch, tokens, 3 * INNER + extra, device="cuda")
    fused[..., 2 * INNER : 3 * INNER] *= V_CHANNELS.cuda()
    return list(fused.to(dtype)[..., : 3 * INNER].chunk(3, dim=-1))


LAYOUTS = {
    "double-separate": lambda b, d: _separate(b, TEXT, d) + _separate(b, IMAGE, d),
    "double-fused": lambda b, d: _fused(b, TEXT, d) + _fused(b, IMAGE, d),
    "single-fused-mlp": lambda b, d: _fused(b, TEXT + IMAGE, d, extra=4 * INNER),
}


def _arguments(layout: str, batch: int, dtype: torch.dtype, with_rope: bool) -> tuple[list, list, list, list]:
    """The prologue ops' arguments: projections, norm weights, RoPE tables, eps."""
    projections = LAYOUTS[layout](batch, dtype)
    norms = len(projections) * 2 // 3
    weights = [torch.rand(HEAD_DIM, device="cuda") + 0.5 for _ in range(norms)]
    angles = torch.rand(TEXT + IMAGE, HEAD_DIM // 2, device="cuda") * 6.3
    rope = [t.repeat_interleave(2, -1).contiguous() for t in (angles.cos(), angles.sin())] if with_rope else []
    return projections, weights, rope, [1e-6] * norms


def _poison(words: int) -> None:
    """Leave NaN (as float32 and as float16 pairs) in the blocks of `words` 4-byte words the caching allocator
    hands out next."""
    for _ in range(3):
        torch.full((words,), 0x7FC07FC0, dtype=torch.int32, device="cuda")


def _poison_split_workspace(groups: int, seq: int) -> None:
    """`_poison` the size of split planes and their maxima in one allocation."""
    _poison((split_halves(groups, seq, seq, HEAD_DIM) * 2 + 3 * groups * HEAD_DIM * 4) // 4)


def _unfused_planes(layout) -> tuple[SplitPlanes, tuple[torch.Tensor, ...]]:
    """(the split kernel's planes of the prologue's f32 q, k, v; those q, k, v)."""
    qkv = qkv_prologue_cuda(layout, torch.float32)
    return split_qkv_cuda(*qkv), qkv


def _assert_same_bits(ours: SplitPlanes, reference: SplitPlanes, what: str) -> None:
    assert ours.planes.shape == reference.planes.shape and ours.colmax.shape == reference.colmax.shape
    assert torch.equal(ours.colmax, reference.colmax), f"{what}: column maxima differ"
    differing = (ours.planes.view(torch.int16) != reference.planes.view(torch.int16)).sum().item()
    assert differing == 0, f"{what}: {differing} plane values differ"


@needs_hopper
@pytest.mark.parametrize("with_rope", [True, False], ids=["rope", "no-rope"])
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_planes_are_the_prologue_then_the_split_bit_for_bit(
    batch: int, dtype: torch.dtype, layout_name: str, with_rope: bool
) -> None:
    arguments = _arguments(layout_name, batch, dtype, with_rope)
    layout = prologue_layout(*arguments)
    assert layout is not None and layout.seq == TEXT + IMAGE
    _poison_split_workspace(batch * HEADS, layout.seq)
    fused = qkv_prologue_split_cuda(layout, one_allocation=True)
    assert not fused.planes.isnan().any(), "unwritten plane values"
    reference, qkv = _unfused_planes(layout)
    _assert_same_bits(fused, reference, "split prologue vs prologue + split")
    _assert_same_bits(split_twin(*qkv), reference, "split twin vs split kernel")
    _poison_split_workspace(batch * HEADS, layout.seq)
    via_op = SplitPlanes(*torch.ops.pictor.qkv_prologue_split(*arguments), HEADS, layout.seq)
    _assert_same_bits(via_op, reference, "the custom op (two allocations) vs prologue + split")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_value_channels_of_every_magnitude(dtype: torch.dtype) -> None:
    """v channels of 1e-4..1e4 through the fused route: the unfused route's output bit for bit, and each output
    channel's error, relative to its magnitude, within 1e-5 or twice SDPA fp32's own on the same q, k, v (the
    normed and rotated q, k can give logits far larger than N(0, 1) inputs do)."""
    arguments = _arguments("double-separate", 2, dtype, with_rope=True)
    layout = prologue_layout(*arguments)
    fused = qkv_prologue_split_cuda(layout)
    reference, qkv = _unfused_planes(layout)
    _assert_same_bits(fused, reference, "wide-range v")
    _poison(2 * layout.seq * INNER)
    out = split_route._attend_split(fused, HEAD_DIM**-0.5, "auto", torch.float32)
    unfused = attention(*qkv, kernel="auto")
    assert torch.equal(out, unfused), "the fused route's output differs from the unfused route's"
    exact = attention_float64(*qkv)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*qkv).transpose(1, 2).flatten(2)
    magnitude = V_CHANNELS.cuda().view(HEADS, HEAD_DIM).double()

    def relative(result: torch.Tensor) -> float:
        err = (result.double() - exact).abs().amax(dim=(0, 1)).view(HEADS, HEAD_DIM)
        return (err / magnitude).max().item()

    ours, sdpa_fp32 = relative(out), relative(sdpa)
    print(f"fused route, v channels 1e-4..1e4, {dtype}: error / magnitude {ours:.3e} (SDPA fp32 {sdpa_fp32:.3e})")
    assert torch.isfinite(out).all() and ours <= max(1e-5, 2 * sdpa_fp32)


def _route_counts(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Launch counts from here on: split prologues, split prepasses (each two launches of the split kernel,
    whether planned or replayed by the plan memo) and fp32-family attention kernels."""
    counts = {"prologue_split": [0], "split_launches": [0], "attention": count_launches(monkeypatch, "fp32")}
    prologue, launch_params = split_route.qkv_prologue_split_cuda, runtime._launch_params
    split = nvrtc.function(split_variant(HEAD_DIM), torch.cuda.current_device())

    def counted_prologue(*args: object, **kwargs: object) -> object:
        counts["prologue_split"][0] += 1
        return prologue(*args, **kwargs)

    def counted_launch(function: int, *args: object) -> None:
        counts["split_launches"][0] += function == split
        launch_params(function, *args)

    monkeypatch.setattr(split_route, "qkv_prologue_split_cuda", counted_prologue)
    monkeypatch.setattr(runtime, "_launch_params", counted_launch)
    return counts


def _counted(counts: dict[str, list[int]]) -> tuple[int, int, int]:
    """(split prologues, split prepasses, attention kernels)."""
    return counts["prologue_split"][0], counts["split_launches"][0] // 2, counts["attention"][0]


@needs_hopper
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_route_gives_the_unfused_output(batch: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_transformer(CONFIG_128, device="cuda", dtype=dtype)
    inputs = transformer_inputs(model, batch, (1, IMAGE), TEXT)
    model.set_attn_processor(PictorAttn())
    counts = _route_counts(monkeypatch)
    fused = model(**inputs)[0]
    assert _counted(counts) == (LAYERS, 0, LAYERS), "the fused route was not taken"
    with monkeypatch.context() as patch:
        patch.setattr(split_route, "_selects_split", lambda *args: False)
        unfused = model(**inputs)[0]
    assert _counted(counts) == (LAYERS, LAYERS, 2 * LAYERS), "the unfused route did not run the split prepass"
    assert fused.dtype == dtype and torch.isfinite(fused).all()
    assert torch.equal(fused, unfused), f"fused and unfused routes differ: rel L2 {rel_l2(fused, unfused):.3e}"
    if dtype == torch.float32:
        exact = build_transformer(CONFIG_128, device="cuda", dtype=torch.float64)
        stock = exact(**transformer_inputs(exact, batch, (1, IMAGE), TEXT))[0]
        error = rel_l2(fused, stock)
        print(f"fused route B{batch}: rel L2 to float64 stock {error:.3e}")
        assert error <= 1e-5


@needs_hopper
@torch.no_grad()
def test_compiled_model_keeps_the_fused_route(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_transformer(CONFIG_128, device="cuda")
    model.set_attn_processor(PictorAttn())
    inputs = transformer_inputs(model, 2, (1, IMAGE), TEXT)
    eager = model(**inputs)[0]
    counts = _route_counts(monkeypatch)
    try:
        traced = torch.compile(model, fullgraph=True)(**inputs)[0]
    finally:
        torch._dynamo.reset()
    assert _counted(counts) == (LAYERS, 0, LAYERS), "the compiled model left the fused route"
    assert rel_l2(traced, eager) <= 1e-5


@needs_hopper
@torch.no_grad()
def test_kv_cache_and_public_attention_keep_the_unfused_route(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_transformer(CONFIG_128, device="cuda", seed=0)
    set_kv_processors(model)
    stock_extract, stock_cached, _ = kv_steps(model, 2)
    model.set_attn_processor(PictorAttn())
    counts = _route_counts(monkeypatch)
    extract, cached, _ = kv_steps(model, 2)
    prologues, prepasses, _ = _counted(counts)
    assert prologues == 0 and prepasses > 0, "a KV-cache step took the fused route"
    assert rel_l2(extract, stock_extract) <= 1e-5 and rel_l2(cached, stock_cached) <= 1e-5
    query, key, value = (torch.randn(1, 2, 75, HEAD_DIM, device="cuda") for _ in range(3))
    attention(query, key, value, kernel="fp16x3")
    assert _counted(counts)[:2] == (0, prepasses + 1), "public attention() did not run the split prepass"
