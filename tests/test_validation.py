"""Every bad input raises its promised error, and the message names the actual value.

`pictor_diffusers.attention` takes `[B, H, N, D]` (any strides) of one dtype
(float32, bfloat16 or float16) on one cpu/cuda device with 1 <= D <= 384; `PictorAttn` serves only FLUX.2's two
attention module types, without masks, KV caching or unknown keywords.
"""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

from pictor_diffusers import PictorAttn, attention
from pictor_diffusers.cuda.runtime import import_cupy

Shape = tuple[int, int, int, int]

# Valid shapes around which each bad input is built: N = 7 and 257 are not multiples of the
# kernel's 8-row / 32-key tiles, D = 200 not a multiple of the 32 lanes.
BASE_SHAPES: list[Shape] = [(1, 2, 7, 32), (2, 3, 257, 200)]
SHAPE_IDS = ["B{}H{}N{}D{}".format(*shape) for shape in BASE_SHAPES]
ARGS = ["query", "key", "value"]


def qkv(shape: Shape, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(3)]


def with_bad(shape: Shape, position: str, bad: object) -> list[object]:
    """Valid q, k, v with the one named by `position` replaced by `bad`."""
    tensors: list[object] = list(qkv(shape))
    tensors[ARGS.index(position)] = bad
    return tensors


@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_valid_inputs_pass(shape: Shape) -> None:
    """The base shapes are valid, so each failure below is due to its one bad property."""
    out = attention(*qkv(shape))
    assert out.shape == (shape[0], shape[2], shape[1] * shape[3])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_unsupported_dtype(shape: Shape, position: str, dtype: torch.dtype) -> None:
    bad = torch.randn(shape).to(dtype)
    with pytest.raises(TypeError, match=rf"^{position} has dtype {re.escape(str(dtype))}; .*float32, bfloat16"):
        attention(*with_bad(shape, position, bad))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_mixed_dtypes(shape: Shape, position: str, dtype: torch.dtype) -> None:
    """One 16-bit tensor among float32 ones: the first that differs from query is named, with both dtypes."""
    bad = torch.randn(shape).to(dtype)
    named, named_dtype, query_dtype = (
        ("key", torch.float32, dtype) if position == "query" else (position, dtype, torch.float32)
    )
    message = f"{named} has dtype {named_dtype} but query has {query_dtype}"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
        attention(*with_bad(shape, position, bad))


@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("bad", [[[1.0]], 3.0, None], ids=["list", "float", "None"])
def test_not_a_tensor(position: str, bad: object) -> None:
    with pytest.raises(TypeError, match=rf"^{position} must be a torch.Tensor, got {type(bad).__name__}$"):
        attention(*with_bad(BASE_SHAPES[0], position, bad))


@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_rank_three(shape: Shape, position: str) -> None:
    flat = (shape[0], shape[2], shape[1] * shape[3])
    tensors = qkv(shape) if position != "query" else [torch.randn(flat)] * 3
    tensors[ARGS.index(position)] = torch.randn(flat)
    with pytest.raises(ValueError, match=rf"^{position} must be head-major .* got shape {re.escape(str(flat))}$"):
        attention(*tensors)


@pytest.mark.parametrize("axis", [0, 1, 3])
@pytest.mark.parametrize("position", ["key", "value"])
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_mismatched_batch_heads_or_head_dim(shape: Shape, position: str, axis: int) -> None:
    other = tuple(n + 1 if i == axis else n for i, n in enumerate(shape))
    message = f"{position} has shape {other} but query has {shape}; batch, heads and head_dim must match"
    with pytest.raises(ValueError, match=re.escape(message)):
        attention(*with_bad(shape, position, torch.randn(other)))


@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_value_tokens_must_match_key(shape: Shape) -> None:
    other = (shape[0], shape[1], shape[2] + 1, shape[3])
    with pytest.raises(ValueError, match=re.escape(f"value has shape {other} but key has {shape}; they must match")):
        attention(*with_bad(shape, "value", torch.randn(other)))


@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_keys_of_another_length_are_accepted(shape: Shape) -> None:
    batch, heads, seq, head_dim = shape
    query = torch.randn(shape)
    key, value = (torch.randn(batch, heads, seq + 5, head_dim) for _ in range(2))
    assert attention(query, key, value).shape == (batch, seq, heads * head_dim)


@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_strided_inputs_give_the_contiguous_result(shape: Shape, position: str) -> None:
    """Any strides are accepted (a token-major view, a transposed copy) and change nothing in the result."""
    batch, heads, seq, head_dim = shape
    strided = torch.randn(batch, heads, head_dim, seq).transpose(-1, -2)
    assert strided.shape == shape and not strided.is_contiguous()
    inputs = with_bad(shape, position, strided)
    contiguous = [t.contiguous() for t in inputs]
    torch.testing.assert_close(attention(*inputs), attention(*contiguous), rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [0, 385, 512])
@pytest.mark.parametrize("seq", [7, 257])
def test_head_dim_out_of_range(seq: int, head_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"^head_dim must be in \[1, 384\], got {head_dim}$"):
        attention(*qkv((1, 2, seq, head_dim)))


@pytest.mark.parametrize(
    ("shape", "named"),
    [((1, 2, 0, 32), "N=0"), ((0, 2, 7, 32), "B=0"), ((2, 0, 7, 200), "H=0")],
    ids=["N0", "B0", "H0"],
)
def test_empty_extent(shape: Shape, named: str) -> None:
    with pytest.raises(ValueError, match=rf"must be >= 1, got .*\b{named}\b"):
        attention(*qkv(shape))


@pytest.mark.parametrize(("shape", "named"), [((65536, 1, 1, 1), "B=65536"), ((1, 65536, 1, 1), "H=65536")])
def test_grid_limit(shape: Shape, named: str) -> None:
    with pytest.raises(ValueError, match=rf"must be <= 65535, got .*\b{named}\b"):
        attention(*qkv(shape))


@pytest.mark.parametrize("position", ARGS)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_meta_device(shape: Shape, position: str) -> None:
    with pytest.raises(ValueError, match=rf"^{position} is on device meta\b"):
        attention(*with_bad(shape, position, torch.empty(shape, device="meta")))


@pytest.mark.parametrize("kernel", ["tf32", "F32", ""])
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_unknown_kernel_choice(shape: Shape, kernel: str) -> None:
    with pytest.raises(ValueError, match=rf"kernel must be one of .*, got {re.escape(repr(kernel))}$"):
        attention(*qkv(shape), kernel=kernel)


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.int32, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("shape", BASE_SHAPES, ids=SHAPE_IDS)
def test_unsupported_out_dtype(shape: Shape, out_dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"out_dtype must be one of .*, got {re.escape(str(out_dtype))}$"):
        attention(*qkv(shape), out_dtype=out_dtype)


@pytest.fixture
def fresh_import_cupy() -> Iterator[None]:
    import_cupy.cache_clear()
    yield
    import_cupy.cache_clear()


@pytest.mark.parametrize(
    ("torch_cuda", "named"), [(None, ("cuda12", "cuda13")), ("12.8", ("cuda12",)), ("13.0", ("cuda13",))]
)
def test_missing_cupy_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, fresh_import_cupy: None, torch_cuda: str | None, named: tuple[str, ...]
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    with pytest.raises(ImportError, match=re.escape(f"torch.version.cuda = {torch_cuda}")) as info:
        import_cupy()
    for extra in ("cuda12", "cuda13"):
        assert (f"pictor-diffusers[{extra}]" in str(info.value)) == (extra in named), str(info.value)


def test_cupy_for_another_cuda_warns_with_the_extra(monkeypatch: pytest.MonkeyPatch, fresh_import_cupy: None) -> None:
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(runtimeGetVersion=lambda: 12080))
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.warns(RuntimeWarning, match=re.escape("CuPy is built for CUDA 12 but torch for CUDA 13.0")) as info:
        assert import_cupy() is fake
    assert "pictor-diffusers[cuda13]" in str(info[0].message)


# PictorAttn --------------------------------------------------------------------------------


def double_module() -> Flux2Attention:
    torch.manual_seed(0)
    return Flux2Attention(query_dim=64, heads=2, dim_head=32, added_kv_proj_dim=64, out_dim=64, processor=PictorAttn())


def single_module() -> Flux2ParallelSelfAttention:
    torch.manual_seed(0)
    return Flux2ParallelSelfAttention(query_dim=64, heads=2, dim_head=32, out_dim=64, mlp_ratio=3.0)


@pytest.mark.parametrize(
    "module", [torch.nn.Linear(4, 4), torch.nn.MultiheadAttention(4, 1)], ids=["Linear", "MultiheadAttention"]
)
def test_unsupported_module(module: torch.nn.Module) -> None:
    with pytest.raises(TypeError, match=rf"not {type(module).__name__}$"):
        PictorAttn()(module, torch.randn(1, 2, 4))


@pytest.mark.parametrize("tokens", [7, 33])
def test_attention_mask_rejected_double(tokens: int) -> None:
    attn, mask = double_module(), torch.ones(2, 1, tokens + 5, tokens + 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=re.escape(f"attention_mask of shape {tuple(mask.shape)}")):
        attn(torch.randn(2, tokens, 64), torch.randn(2, 5, 64), attention_mask=mask)


@pytest.mark.parametrize("tokens", [7, 33])
def test_attention_mask_rejected_single(tokens: int) -> None:
    attn, mask = single_module(), torch.ones(2, 1, tokens, tokens, dtype=torch.bool)
    attn.set_processor(PictorAttn())
    with pytest.raises(ValueError, match=re.escape(f"attention_mask of shape {tuple(mask.shape)}")):
        attn(torch.randn(2, tokens, 64), attention_mask=mask)


def test_encoder_states_without_text_projections() -> None:
    attn = Flux2Attention(query_dim=64, heads=2, dim_head=32, processor=PictorAttn())
    with pytest.raises(ValueError, match=r"added_kv_proj_dim=None"):
        attn(torch.randn(1, 7, 64), torch.randn(1, 5, 64))


@pytest.mark.parametrize("key", ["foo", "attn_mask"])
def test_unknown_kwarg(key: str) -> None:
    with pytest.raises(TypeError, match=rf"kwargs \['{key}'\]"):
        PictorAttn()(double_module(), torch.randn(1, 7, 64), torch.randn(1, 5, 64), **{key: 1})


@pytest.mark.parametrize("mode", ["replay", "EXTRACT"])
def test_unknown_kv_cache_mode_is_refused(mode: str) -> None:
    message = rf"kv_cache_mode must be one of \('extract', 'cached'\) or None, got '{mode}'"
    with pytest.raises(ValueError, match=message):
        PictorAttn()(single_module(), torch.randn(1, 7, 64), kv_cache_mode=mode, num_ref_tokens=2)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_non_positive_or_non_finite_scale_is_refused(scale: float) -> None:
    query = torch.randn(1, 2, 9, 16)
    with pytest.raises(ValueError, match=f"scale must be a finite positive number, got {scale}"):
        attention(query, query, query, scale=scale)


@pytest.mark.parametrize("scale", [1e-40, 1e39])
def test_scale_outside_float32_range_is_refused(scale: float) -> None:
    query = torch.randn(1, 2, 7, 32)
    with pytest.raises(ValueError, match=re.escape(f"scale={scale} is outside float32's normal range")):
        attention(query, query, query, scale=scale)


def test_raw_custom_op_validates_its_inputs() -> None:
    """torch.ops.pictor.attention is public too: it must not trust its caller."""
    query = torch.randn(1, 2, 9, 16)
    with pytest.raises(TypeError, match=r"value has dtype torch\.float64; pictor attention takes"):
        torch.ops.pictor.attention(query, query, query.double(), 0.25, "auto", "float32")


def test_backward_says_inference_only() -> None:
    query = torch.randn(1, 2, 9, 16, requires_grad=True)
    out = attention(query, query, query)
    with pytest.raises(NotImplementedError, match="inference-only"):
        out.sum().backward()


def _prologue_args(text_batch: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    text = [torch.randn(text_batch, 5, 64) for _ in range(3)]
    image = [torch.randn(2, 7, 64) for _ in range(3)]
    weights = [torch.ones(32) for _ in range(4)]
    rope = [torch.ones(12, 32), torch.zeros(12, 32)]
    return text + image, weights, rope


def test_prologue_blocker_accepts_a_valid_layout() -> None:
    from pictor_diffusers.cuda.prologue_layout import prologue_layout_problem

    projections, weights, rope = _prologue_args()
    assert prologue_layout_problem(projections, weights, rope, [1e-6] * 4) is None


@pytest.mark.parametrize(
    ("break_it", "reason"),
    [
        (lambda p, w, r: p.__setitem__(0, p[0][:1]), "batch"),
        (lambda p, w, r: p.__setitem__(1, p[1][:, :3]), "token count"),
        (lambda p, w, r: w.__setitem__(0, torch.ones(32, dtype=torch.float64)), "norm weights"),
        (lambda p, w, r: r.__setitem__(0, torch.ones(11, 32)), "rope"),
        (lambda p, w, r: p.__setitem__(3, torch.randn(2, 7, 60)), "batch or width"),
    ],
    ids=["text-batch", "kv-length", "weight-dtype", "rope-shape", "width"],
)
def test_prologue_blocker_refuses_inconsistent_shapes(break_it, reason: str) -> None:
    """The kernel trusts these shapes; the blocker hands such calls to torch, which raises or copes."""
    from pictor_diffusers.cuda.prologue_layout import prologue_layout_problem

    projections, weights, rope = _prologue_args()
    break_it(projections, weights, rope)
    problem = prologue_layout_problem(projections, weights, rope, [1e-6] * 4)
    assert problem is not None and reason in problem


def test_norm_params_read_a_parametrized_weight() -> None:
    """A weight computed by a parametrization is not in `_parameters`: it is read through the module."""
    from torch.nn.utils import parametrize

    from pictor_diffusers.ops.prologue import norm_params

    class Double(torch.nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return 2 * weight

    norm = torch.nn.RMSNorm(8, eps=1e-5)
    parametrize.register_parametrization(norm, "weight", Double())
    weight, eps = norm_params(norm, 8, torch.zeros(1))
    assert torch.equal(weight, torch.full((8,), 2.0)) and eps == 1e-5
    assert torch.equal(norm_params(torch.nn.RMSNorm(8, elementwise_affine=False), 8, torch.zeros(1))[0], torch.ones(8))


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dim", [64, 100])
def test_a_16bit_norm_weight_is_cast_once_until_changed(dtype: torch.dtype, dim: int) -> None:
    from pictor_diffusers.ops.prologue import norm_params

    norm = torch.nn.RMSNorm(dim, eps=1e-6).to(dtype)
    norm.weight.copy_(torch.randn(dim))
    first, _ = norm_params(norm, dim, torch.zeros(1))
    assert first.dtype == torch.float32 and torch.equal(first, norm.weight.float())
    assert norm_params(norm, dim, torch.zeros(1))[0] is first
    norm.weight.mul_(3)
    changed, _ = norm_params(norm, dim, torch.zeros(1))
    assert changed is not first and torch.equal(changed, norm.weight.float())
    norm.weight = torch.nn.Parameter(torch.randn(dim, dtype=dtype))
    assert torch.equal(norm_params(norm, dim, torch.zeros(1))[0], norm.weight.float())


def test_a_float32_norm_weight_is_used_as_is() -> None:
    from pictor_diffusers.ops.prologue import norm_params

    norm = torch.nn.RMSNorm(24)
    assert norm_params(norm, 24, torch.zeros(1))[0] is norm.weight


def _fused_projections(batch: int, tokens: int, width: int = 64) -> list[torch.Tensor]:
    return list(torch.randn(batch, tokens, 3 * width + 8)[..., : 3 * width].chunk(3, dim=-1))


PROLOGUE_LAYOUTS = {
    "separate": lambda: _prologue_args(),
    "fused": lambda: (_fused_projections(2, 5) + _fused_projections(2, 7), *_prologue_args()[1:]),
    "one-segment": lambda: (_fused_projections(2, 12), _prologue_args()[1][:2], _prologue_args()[2]),
    "no-rope": lambda: (*_prologue_args()[:2], []),
    "misaligned": lambda: (
        [t[..., 1:] for t in _fused_projections(2, 5, 65)] + [t[..., 1:] for t in _fused_projections(2, 7, 65)],
        *_prologue_args()[1:],
    ),
    "text-batch": lambda: (_prologue_args(text_batch=1)[0], *_prologue_args()[1:]),
    "f64-weight": lambda: (_prologue_args()[0], [torch.ones(32, dtype=torch.float64)] * 4, _prologue_args()[2]),
    "rope-rows": lambda: (*_prologue_args()[:2], [torch.ones(11, 32), torch.zeros(11, 32)]),
    "head_dim-130": lambda: ([torch.randn(2, 5, 260) for _ in range(6)], [torch.ones(130)] * 4, []),
}


@pytest.mark.parametrize("name", list(PROLOGUE_LAYOUTS))
def test_prologue_fast_layout_agrees_with_the_detailed_checks(name: str) -> None:
    """`prologue_layout` (read once, used for the launch) accepts exactly what the detailed checks accept."""
    from pictor_diffusers.cuda.prologue_layout import prologue_layout, prologue_layout_problem

    projections, weights, rope = PROLOGUE_LAYOUTS[name]()
    eps = [1e-6] * len(weights)
    layout = prologue_layout(projections, weights, rope, eps)
    problem = prologue_layout_problem(projections, weights, rope, eps)
    assert (layout is None) == (problem is not None), (name, problem)
    assert (problem is None) == (name in ("separate", "fused", "one-segment", "no-rope"))


def test_prologue_layout_holds_the_kernel_arguments() -> None:
    """Pointers in kernel order, row/batch strides in elements; one segment is an empty text part."""
    from pictor_diffusers.cuda.prologue_layout import prologue_layout

    text, image = _fused_projections(2, 5), _fused_projections(2, 7)
    _, weights, rope = _prologue_args()
    layout = prologue_layout(text + image, weights, rope, [1e-5, 1e-6] * 2)
    tensors = [*text, *image, *weights, *rope]
    assert layout.pointers == [t.data_ptr() for t in tensors]
    assert layout.strides == (200, 1000, 200, 1400)
    assert (layout.batch, layout.text_len, layout.seq, layout.heads, layout.head_dim) == (2, 5, 12, 2, 32)
    assert layout.eps == (1e-5, 1e-6) and layout.rope and layout.device_index == -1
    single = prologue_layout(image, weights[:2], [], [1e-6] * 2)
    assert single.text_len == 0 and single.seq == 7 and not single.rope
    expected = (*image, *image, *weights[:2], *weights[:2], weights[0], weights[0])
    assert single.pointers == [t.data_ptr() for t in expected]
