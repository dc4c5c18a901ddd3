"""The 16-bit attention kernels (wgmma on sm_90, mma16 on sm_80+) against float64 SDPA.

flash-attention's habit: the truth is float64 SDPA on the *same* 16-bit-rounded
inputs, and the bound is torch SDPA's own error in that 16-bit dtype on those
inputs (default backend; the math backend computing in 16-bit is printed too).
Every launch writes into a NaN-poisoned output; inputs are fresh N(0,1) draws.
A kernel that cannot run on this device (its blocker says why) is skipped.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import attention
from pictor_diffusers.cuda.launch import run
from pictor_diffusers.cuda.plan import cannot_run, plan_attention
from pictor_diffusers.cuda.registry import BY_NAME, SHORT_KEYS
from pictor_diffusers.testing.references import attention_float64, random_qkv

pytestmark = pytest.mark.gpu

# metric -> (factor on SDPA-16-bit's own error, absolute floor)
TOLERANCE = {"rel_l2": (1.5, 1e-5), "max_abs": (2.0, 1e-5)}

KERNEL_HEAD_DIMS = {name: BY_NAME[name].head_dims for name in ("wgmma", "mma16")}
DTYPES = [torch.bfloat16, torch.float16]

# (B, H, N, D): FLUX.2 at 512²/1024² with 24 and 48 heads; odd N, not multiples of the
# 128- or 192-row query blocks (192: wgmma at head_dim 64) nor of the 64-, 128- or 176-key tiles; N = 1;
# at head_dim 64, N below one 192-row block and between 128 and 192 (the third consumer warpgroup's rows
# past N).
SHAPES = [
    (1, 24, 4608, 128),
    (2, 24, 1536, 128),
    (1, 48, 4608, 128),
    (1, 24, 1, 128),
    (2, 3, 77, 128),
    (1, 4, 1000, 64),
    (2, 5, 4097, 128),
    (2, 5, 4097, 64),
    (1, 24, 1536, 64),
    (2, 3, 77, 64),
    (1, 4, 150, 64),
    (1, 24, 1, 64),
]
CASES = [(kernel, shape) for kernel in KERNEL_HEAD_DIMS for shape in SHAPES if shape[3] in KERNEL_HEAD_DIMS[kernel]]
Shape = tuple[int, int, int, int]


def _id(value: object) -> str:
    if isinstance(value, tuple):
        return "B{}-H{}-N{}-D{}".format(*value)
    return str(value).removeprefix("torch.")


def qkv16(shape: Shape, dtype: torch.dtype, seed: int, mult: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Fresh N(0, mult²) q, k, v rounded to `dtype`, head-major and contiguous."""
    return tuple(t.to(dtype) for t in random_qkv(*shape, seed=seed, scale=mult))


def blocker_or_skip(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    reason = cannot_run(kernel, query, key, value)
    if reason is not None:
        pytest.skip(f"{kernel} cannot run here: {reason}")


def launch(kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One direct launch of `kernel` into a NaN-poisoned `[B, N, H*D]` output of the inputs' dtype."""
    batch, heads, seq, head_dim = query.shape
    out = torch.full((batch, seq, heads * head_dim), float("nan"), device=query.device, dtype=query.dtype)
    result = run(plan_attention(query, key, value, head_dim**-0.5, kernel, query.dtype, out=out))
    assert result.data_ptr() == out.data_ptr(), "the kernel did not write into the given out"
    return out


def sdpa16(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, math: bool = False) -> torch.Tensor:
    """torch SDPA in the inputs' 16-bit dtype, token-major; `math` forces the math backend computing in 16-bit."""
    with contextlib.ExitStack() as stack:
        if math:
            allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
            stack.callback(torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp, allowed)
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        out = F.scaled_dot_product_attention(query, key, value)
    batch, heads, seq, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.double() - ref
    return {"rel_l2": (diff.norm() / ref.norm()).item(), "max_abs": diff.abs().max().item()}


def assert_within_sdpa16(
    label: str, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """`out` is finite, fully written and within TOLERANCE of default SDPA's own 16-bit error."""
    assert not out.isnan().any(), f"{label}: poisoned (unwritten) or NaN elements"
    assert torch.isfinite(out).all(), f"{label}: Inf in the output"
    ref = attention_float64(query, key, value)
    ours, sdpa = errors(out, ref), errors(sdpa16(query, key, value), ref)
    math = errors(sdpa16(query, key, value, math=True), ref)
    print(
        f"KERNEL16 {label}: ours rel_l2 {ours['rel_l2']:.2e} max_abs {ours['max_abs']:.2e} | sdpa "
        f"{sdpa['rel_l2']:.2e} {sdpa['max_abs']:.2e} | sdpa-math-16 {math['rel_l2']:.2e} {math['max_abs']:.2e}"
    )
    for metric, (factor, floor) in TOLERANCE.items():
        bound = factor * sdpa[metric] + floor
        assert ours[metric] <= bound, (
            f"{label}: {metric} {ours[metric]:.3e} > {factor} x SDPA-{_id(query.dtype)}'s {sdpa[metric]:.3e} + {floor}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("kernel", "shape"), CASES, ids=_id)
def test_kernel_within_sdpa_error(kernel: str, shape: Shape, dtype: torch.dtype) -> None:
    query, key, value = qkv16(shape, dtype, seed=sum(shape))
    blocker_or_skip(kernel, query, key, value)
    out = launch(kernel, query, key, value)
    torch.cuda.synchronize()
    assert out.shape == (shape[0], shape[2], shape[1] * shape[3]) and out.dtype == dtype
    assert_within_sdpa16(f"{kernel} {_id(dtype)} {_id(shape)}", out, query, key, value)


LARGE_LOGIT_CASES = [(kernel, shape) for kernel, shape in CASES if shape in {(1, 24, 4608, 128), (2, 3, 77, 128)}]


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("kernel", "shape"), LARGE_LOGIT_CASES, ids=_id)
def test_large_logits(kernel: str, shape: Shape, dtype: torch.dtype) -> None:
    """q, k, v x8 (logits up to ~300): no overflow of the running max or sum, same bound."""
    query, key, value = qkv16(shape, dtype, seed=7, mult=8.0)
    blocker_or_skip(kernel, query, key, value)
    out = launch(kernel, query, key, value)
    torch.cuda.synchronize()
    assert_within_sdpa16(f"{kernel} {_id(dtype)} {_id(shape)} x8", out, query, key, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("kernel", list(KERNEL_HEAD_DIMS))
def test_bitwise_deterministic(kernel: str, dtype: torch.dtype) -> None:
    query, key, value = qkv16((2, 24, 1536, 128), dtype, seed=11)
    blocker_or_skip(kernel, query, key, value)
    first = launch(kernel, query, key, value)
    second = launch(kernel, query, key, value)
    assert torch.equal(first, second)


@pytest.mark.parametrize("kernel", list(KERNEL_HEAD_DIMS))
def test_non_default_stream_with_concurrent_work(kernel: str) -> None:
    query, key, value = qkv16((1, 24, 1536, 128), torch.bfloat16, seed=5)
    blocker_or_skip(kernel, query, key, value)
    expected = launch(kernel, query, key, value)
    side = torch.cuda.Stream()
    busy = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q2, k2, v2 = (t * 1.0 for t in (query, key, value))
        out = attention(q2, k2, v2, kernel=kernel)
        checksum = out.float().sum()
    for _ in range(4):
        busy = busy @ busy / 8192.0
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected), "the side-stream result differs from the default-stream launch"
    assert torch.isfinite(checksum)


@pytest.mark.parametrize("kernel", list(KERNEL_HEAD_DIMS))
def test_cuda_graph_capture_and_replay(kernel: str) -> None:
    shape = (1, 24, 1000, 128)
    query, key, value = qkv16(shape, torch.bfloat16, seed=9)
    blocker_or_skip(kernel, query, key, value)
    attention(query, key, value, kernel=kernel)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attention(query, key, value, kernel=kernel)
    for seed in (21, 22):
        fresh = qkv16(shape, torch.bfloat16, seed=seed)
        for static, new in zip((query, key, value), fresh, strict=True):
            static.copy_(new)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, launch(kernel, *fresh)), f"replay with seed {seed} differs from eager"


def expected_auto_kernel(query: torch.Tensor) -> str:
    """What a user of this GPU gets for a plain kernel="auto" call, written out by hand: Hopper runs
    wgmma at head_dim 64 and 128; every other call goes to torch's SDPA (no other 16-bit kernel was
    measured faster than it)."""
    capability, head_dim = torch.cuda.get_device_capability(query.device), query.shape[-1]
    return "wgmma" if capability == (9, 0) and head_dim in (64, 128) else "sdpa"


def sdpa_token_major(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """torch's SDPA of `[B, H, N, D]` inputs, token-major `[B, N, H*D]`."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
    return out.transpose(1, 2).reshape(query.shape[0], query.shape[2], -1)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(1, 24, 1536, 128), (1, 4, 1000, 64), (1, 3, 77, 32)], ids=_id)
def test_auto_picks_the_expected_kernel(shape: Shape, dtype: torch.dtype) -> None:
    query, key, value = qkv16(shape, dtype, seed=17)
    expected = expected_auto_kernel(query)
    out = attention(query, key, value)
    assert out.dtype == dtype and out.shape == (shape[0], shape[2], shape[1] * shape[3])
    if expected == "sdpa":
        direct = sdpa_token_major(query, key, value)
    else:
        direct = launch(expected, query, key, value)
    print(f"auto {_id(dtype)} {_id(shape)} -> {expected}")
    assert torch.equal(out, direct), f"kernel='auto' does not match a direct launch of {expected}"


@pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])
@pytest.mark.parametrize("seq_k", [SHORT_KEYS, SHORT_KEYS + 1])
def test_short_key_sequences_run_the_persistent_build(seq_k: int, head_dim: int) -> None:
    """Cross-attention over at most SHORT_KEYS keys runs wgmma's persistent build, longer keys the other; both
    within SDPA's error (3000 queries: 24 x 40 = 960 work tiles at head_dim 128, 16 x 40 = 640 of 192 rows at
    64, more than the SMs)."""
    query = qkv16((1, 40, 3000, head_dim), torch.bfloat16, seed=5)[0]
    key, value = qkv16((1, 40, seq_k, head_dim), torch.bfloat16, seed=6)[1:]
    blocker_or_skip("wgmma", query, key, value)
    plan = plan_attention(query, key, value, head_dim**-0.5, "wgmma", query.dtype)
    assert plan.selection.variant.persistent == (seq_k <= SHORT_KEYS)
    assert_within_sdpa16(f"wgmma D{head_dim} Nk={seq_k}", launch("wgmma", query, key, value), query, key, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("seq_k", [2112, 2113, 2287, 4097])
def test_key_tails_of_176_key_tiles(seq_k: int, dtype: torch.dtype) -> None:
    """More than SHORT_KEYS keys at head_dim 128 run wgmma's one-block build, whose key tiles are 176 keys:
    whole tiles (2112 = 12 x 176), one key past them, one key short of 13 (2287), a partial last tile (4097);
    300 queries (a partial query block). Within SDPA's error."""
    query = qkv16((2, 5, 300, 128), dtype, seed=7)[0]
    key, value = qkv16((2, 5, seq_k, 128), dtype, seed=8)[1:]
    blocker_or_skip("wgmma", query, key, value)
    plan = plan_attention(query, key, value, 128**-0.5, "wgmma", query.dtype)
    assert not plan.selection.variant.persistent and plan.selection.variant.key_rows == 176
    assert_within_sdpa16(f"wgmma D128 Nk={seq_k}", launch("wgmma", query, key, value), query, key, value)


@pytest.mark.parametrize("kernel", list(KERNEL_HEAD_DIMS))
def test_explicit_kernel_that_cannot_run_names_the_reason(kernel: str) -> None:
    """head_dim 32 has no 16-bit variant: asking for one by name raises the blocker's reason."""
    query, key, value = qkv16((1, 2, 77, 32), torch.bfloat16, seed=3)
    reason = cannot_run(kernel, query, key, value)
    assert reason is not None, f"{kernel} claims it can run head_dim 32"
    assert f"kernel={kernel!r}" in reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        attention(query, key, value, kernel=kernel)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_misaligned_inputs_fall_back(dtype: torch.dtype) -> None:
    """Views one element into their storage are not 16-byte aligned: both 16-bit kernels refuse them,
    asking for one says why; "auto" hands a plain call to SDPA and runs the f32 kernels on the upcast
    inputs when the LSE is asked for."""
    shape = (1, 4, 300, 128)
    numel = 4 * 300 * 128
    storage = qkv16((1, 1, 3, numel + 1), dtype, seed=23)[0].flatten()
    query, key, value = (storage[i * (numel + 1) + 1 : (i + 1) * (numel + 1)].view(shape) for i in range(3))
    assert query.is_contiguous() and query.data_ptr() % 16
    for kernel in KERNEL_HEAD_DIMS:
        reason = cannot_run(kernel, query, key, value)
        assert reason is not None and "aligned" in reason, f"{kernel} accepts misaligned inputs: {reason}"
        with pytest.raises(ValueError, match=re.escape(reason)):
            attention(query, key, value, kernel=kernel)
    assert torch.equal(attention(query, key, value), sdpa_token_major(query, key, value))
    out, lse = attention(query, key, value, return_lse=True)
    upcast_out, upcast_lse = attention(query.float(), key.float(), value.float(), out_dtype=dtype, return_lse=True)
    assert torch.equal(out, upcast_out) and torch.equal(lse, upcast_lse)


def _layouts(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """`tensor` `[B, H, N, D]` laid out three other ways, same values: a token-major view (what diffusers'
    dispatcher passes), rows of a longer head-major tensor, and a view one element into its storage
    (not 16-byte aligned: no kernel can read it in place)."""
    batch, heads, seq, head_dim = tensor.shape
    token_major = tensor.transpose(1, 2).contiguous().transpose(1, 2)
    longer = torch.empty(batch, heads, seq + 5, head_dim, dtype=tensor.dtype, device=tensor.device)
    longer[:, :, :seq] = tensor
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    shifted = storage[1:].view(batch, seq, heads, head_dim).transpose(1, 2)
    shifted.copy_(tensor)
    return {"token_major": token_major, "row_slice": longer[:, :, :seq], "unaligned": shifted}


STRIDED_SHAPES = [(2, 3, 77, 128), (1, 24, 4608, 128), (2, 5, 4097, 128), (1, 4, 1000, 64), (2, 3, 77, 64)]


@pytest.mark.parametrize("layout", ["token_major", "row_slice", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("kernel", "shape"), [c for c in CASES if c[1] in STRIDED_SHAPES], ids=_id)
def test_strided_inputs(kernel: str, shape: Shape, dtype: torch.dtype, layout: str) -> None:
    """Strided q/k/v give the contiguous inputs' result bit for bit. The wgmma kernel reads aligned
    strided layouts in place (its tensor maps carry the strides): the call allocates nothing; the other
    kernel, and layouts no kernel reads, get contiguous copies first."""
    contiguous = qkv16(shape, dtype, seed=29)
    blocker_or_skip(kernel, *contiguous)
    strided = [_layouts(t)[layout] for t in contiguous]
    assert not any(t.is_contiguous() for t in strided)
    expected = launch(kernel, *contiguous)
    out = torch.full_like(expected, float("nan"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    run(plan_attention(*strided, shape[3] ** -0.5, kernel, dtype, out=out))
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert torch.equal(out, expected), f"{kernel} {layout}: differs from the contiguous inputs' result"
    in_place = kernel == "wgmma" and layout != "unaligned"
    assert allocations == (0 if in_place else 3), f"{kernel} {layout}: {allocations} allocations"


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_windows_handed_to_sdpa_fill_one_output(dtype: torch.dtype) -> None:
    """A windowed call "auto" hands to SDPA (head_dim 32) writes each window's rows of one output, as
    SDPA on that window's slices gives them."""
    from pictor_diffusers.cuda.geometry import Window
    from pictor_diffusers.ops.attention import windowed_attention

    query, key, value = qkv16((2, 3, 301, 32), dtype, seed=29)
    assert expected_auto_kernel(query) == "sdpa"
    windows = [Window(0, 7, 0, 301), Window(7, 200, 7, 200), Window(200, 301, 0, 301)]
    out = windowed_attention(query, key, value, windows, out_dtype=dtype)
    for w in windows:
        rows, keys = slice(w.q_start, w.q_stop), slice(w.k_start, w.k_stop)
        expected = sdpa_token_major(query[:, :, rows], key[:, :, keys], value[:, :, keys])
        assert torch.equal(out[:, rows], expected), f"window {w} differs from SDPA on its slices"
