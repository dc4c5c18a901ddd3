"""A tiny FLUX.1 transformer on CUDA through pictor's backends and `PictorAttn`, against diffusers' native backend.

Paths: `set_attention_backend("pictor" / "pictor_bf16")`, the
`attention_backend(...)` context manager, and `PictorAttn()` /
`PictorAttn(precision="bf16")`. head_dim 128, so the 16-bit paths reach the
16-bit kernels (wgmma on Hopper). Launches of `launch.launch_attention` are
counted by kernel family: every attention module runs exactly one pictor
kernel of the path's family.

* float32 model, f32-accurate paths: relative L2 <= 1e-5 to native.
* bf16 model, every path: within 2x the distance between native and native on
  SDPA's math backend (the yardstick of test_gpu_model16.py), + 1e-4.

Token counts: 138 (not a multiple of 128) and 128, batch 1 and 2, separate and
fused projections. Direct dispatcher calls: masks and `pictor_bf16` reading token-major
q/k/v in place (head_dim 128 and 64: wgmma's 192-row query blocks there), and
`pictor_fp8` running the 8-bit kernel (its 16-bit fallback at head_dim 64).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, attention_backend
from diffusers.models.transformers.transformer_flux import FluxAttention
from torch.nn.attention import SDPBackend, sdpa_kernel

from pictor_diffusers import PictorAttn
from pictor_diffusers.cuda import launch
from pictor_diffusers.integration.precision import PRECISIONS
from pictor_diffusers.testing.models import (
    build_flux1_transformer,
    flux1_transformer_inputs,
    set_flux1_stock_processors,
)

pytestmark = pytest.mark.gpu

TINY_FLUX1_D128 = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 128,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FP32_REL_L2_TOL = 1e-5
YARDSTICK_FACTOR, YARDSTICK_FLOOR = 2.0, 1e-4

PATHS = {
    "set_attention_backend-pictor": ("set_attention_backend", "pictor", "fp32"),
    "set_attention_backend-pictor_bf16": ("set_attention_backend", "pictor_bf16", "16bit"),
    "attention_backend-pictor_bf16": ("attention_backend", "pictor_bf16", "16bit"),
    "PictorAttn-fp32": ("PictorAttn", "fp32", "fp32"),
    "PictorAttn-bf16": ("PictorAttn", "bf16", "16bit"),
}
"""path id -> (how it is applied, backend name or PictorAttn precision, kernel family it must launch)."""

# (batch, latent (height, width), text tokens)
CASES = {"b1-138tok": (1, (9, 13), 21), "b2-128tok": (2, (8, 8), 64)}
VARIANTS = [
    pytest.param(dtype, path, id=f"{str(dtype).removeprefix('torch.')}-{path}")
    for dtype in (torch.float32, torch.bfloat16)
    for path in PATHS
    if dtype == torch.bfloat16 or PATHS[path][2] == "fp32"
]


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@contextmanager
def count_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Launches of pictor's attention kernels inside the block, by kernel family ("fp32", "16bit")."""
    calls = {"fp32": 0, "16bit": 0}
    original = launch.launch_attention

    def counting(plan: launch.AttentionPlan, written: object = None) -> None:
        calls[plan.selection.variant.spec.family] += 1
        original(plan, written)

    with monkeypatch.context() as patch:
        patch.setattr(launch, "launch_attention", counting)
        yield calls


@contextmanager
def native_afterwards() -> Iterator[None]:
    """Restore diffusers' global active backend (`set_attention_backend` also sets it)."""
    active = _AttentionBackendRegistry._active_backend
    try:
        yield
    finally:
        _AttentionBackendRegistry._active_backend = active


@torch.no_grad()
def native_outputs(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(native backend output, native output on SDPA's math backend) of the stock processor."""
    set_flux1_stock_processors(model)
    with attention_backend(AttentionBackendName.NATIVE):
        native = model(**inputs)[0]
        with sdpa_kernel(SDPBackend.MATH):
            math = model(**inputs)[0]
    return native, math


@torch.no_grad()
def run_path(model: torch.nn.Module, inputs: dict, path: str) -> torch.Tensor:
    """The model's output through `path`; leaves the stock processor and the native backend behind."""
    how, name, _ = PATHS[path]
    with native_afterwards():
        if how == "set_attention_backend":
            model.set_attention_backend(name)
            out = model(**inputs)[0]
            model.reset_attention_backend()
        elif how == "attention_backend":
            with attention_backend(name):
                out = model(**inputs)[0]
        else:
            model.set_attn_processor(PictorAttn(precision=name))
            out = model(**inputs)[0]
    set_flux1_stock_processors(model)
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("dtype", "path"), VARIANTS)
def test_flux1_against_native(
    dtype: torch.dtype, path: str, case: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_flux1_transformer(TINY_FLUX1_D128, device="cuda", dtype=dtype)
    if fused:
        model.fuse_qkv_projections()
    batch, latent_hw, text_len = CASES[case]
    inputs = flux1_transformer_inputs(model, batch, latent_hw, text_len)
    native, math = native_outputs(model, inputs)
    with count_launches(monkeypatch) as calls:
        ours = run_path(model, inputs, path)
    family = PATHS[path][2]
    modules = sum(isinstance(m, FluxAttention) for m in model.modules())
    assert modules == TINY_FLUX1_D128["num_layers"] + TINY_FLUX1_D128["num_single_layers"]
    other = "16bit" if family == "fp32" else "fp32"
    assert calls[family] == modules and calls[other] == 0, f"{path}: launches {calls} for {modules} attentions"
    assert ours.shape == native.shape == (batch, latent_hw[0] * latent_hw[1], TINY_FLUX1_D128["in_channels"])
    assert ours.dtype == dtype and torch.isfinite(ours).all()

    error, spread = rel_l2(ours, native), rel_l2(math, native)
    print(f"{dtype} {path} {case} fused={fused}: rel L2 {error:.2e}, native vs math {spread:.2e}")
    if dtype == torch.float32:
        assert error <= FP32_REL_L2_TOL, f"rel L2 {error:.3e} to native > {FP32_REL_L2_TOL}"
    else:
        bound = YARDSTICK_FACTOR * spread + YARDSTICK_FLOOR
        assert error <= bound, f"rel L2 {error:.3e} to native > {YARDSTICK_FACTOR} x native-vs-math {spread:.3e} + 1e-4"

    with torch.no_grad(), count_launches(monkeypatch) as after:
        model(**inputs)
    assert after == {"fp32": 0, "16bit": 0}, f"pictor stayed active after {path}: {after}"


MASKED_KERNELS = {"pictor": "fp32", "pictor_bf16": "16bit"}


HEAD_DIMS = pytest.mark.parametrize("head_dim", [128, 64], ids=["D128", "D64"])


@HEAD_DIMS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MASKED_KERNELS))
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(3, 300, 300), (2, 4096, 4096 + 77)])
def test_key_padding_mask(
    batch: int, seq_q: int, seq_k: int, name: str, dtype: torch.dtype, head_dim: int, monkeypatch
) -> None:
    """A Qwen-Image-style `[B, 1, 1, Nk]` bool mask (holes anywhere; one batch keeps no key) served by one
    pictor launch on CUDA tensors, against float64 SDPA with the same mask (16-bit: on the rounded inputs)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    generator = torch.Generator(device="cuda").manual_seed(seq_k)
    query = torch.randn(batch, seq_q, 4, head_dim, device="cuda", generator=generator).to(dtype)
    key, value = (torch.randn(batch, seq_k, 4, head_dim, device="cuda", generator=generator).to(dtype) for _ in "kv")
    mask = torch.rand(batch, 1, 1, seq_k, device="cuda", generator=generator) > 0.3
    mask[1] = False
    compute = torch.float32 if name == "pictor" else torch.bfloat16
    rounded = [t.to(compute).double().transpose(1, 2) for t in (query, key, value)]
    exact = torch.nn.functional.scaled_dot_product_attention(*rounded, attn_mask=mask).transpose(1, 2)
    native = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native")
    with count_launches(monkeypatch) as calls:
        out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=name)
    assert calls[MASKED_KERNELS[name]] == 1 and sum(calls.values()) == 1, calls
    assert out.shape == query.shape and out.dtype == dtype and (out[1] == 0).all()
    error = ((out.double() - exact).norm() / exact.norm()).item()
    kept = [b for b in range(batch) if b != 1]  # native's rows with no key differ by kernel: not a yardstick
    native_error = ((native[kept].double() - exact[kept]).norm() / exact[kept].norm()).item()
    bound = FP32_REL_L2_TOL if compute == dtype == torch.float32 else 2.0 * native_error + 4e-3
    print(
        f"mask B{batch} Nq{seq_q} Nk{seq_k} D{head_dim} {name} {dtype}: rel L2 {error:.2e} (native {native_error:.2e})"
    )
    assert error <= bound, f"{name} {dtype}: rel L2 {error:.3e} > {bound:.3e}"


@HEAD_DIMS
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(2, 6144, 128), (2, 333, 1000)])
def test_ltx_float_mask_is_a_key_bias_without_sync(
    batch: int, seq_q: int, seq_k: int, head_dim: int, monkeypatch
) -> None:
    """LTX-Video's `[B, H, 1, Nk]` bf16 mask of 0 and -10000 (fresh each call, as its processor repeats it per
    head) through `pictor_bf16` on Hopper: one 16-bit launch with the mask as a key bias, no host sync, within
    native's error of float64 SDPA."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from pictor_diffusers.cuda.plan import cannot_run

    generator = torch.Generator(device="cuda").manual_seed(seq_q + seq_k)
    query = torch.randn(batch, seq_q, 4, head_dim, device="cuda", generator=generator).bfloat16()
    key, value = (torch.randn(batch, seq_k, 4, head_dim, device="cuda", generator=generator).bfloat16() for _ in "kv")
    if cannot_run("wgmma", *(t.transpose(1, 2).contiguous() for t in (query, key, value))) is not None:
        pytest.skip("the wgmma kernel (Hopper) cannot run here")
    kept = torch.rand(batch, 1, 1, seq_k, device="cuda", generator=generator) > 0.3
    mask = ((1 - kept.bfloat16()) * -10000.0).expand(batch, 4, 1, seq_k).contiguous()
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=mask.double()
    ).transpose(1, 2)
    native = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native")
    torch.cuda.synchronize()
    with count_launches(monkeypatch) as calls:
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="pictor_bf16")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert calls["16bit"] == 1 and sum(calls.values()) == 1, calls
    error, native_error = (rel_l2_of(t, exact) for t in (out, native))
    print(f"LTX mask B{batch} Nq{seq_q} Nk{seq_k} D{head_dim}: rel L2 {error:.2e} (native {native_error:.2e})")
    assert error <= 1.5 * native_error + 1e-3


@HEAD_DIMS
def test_ltx_float_mask_compiled_is_the_eager_key_bias(head_dim: int) -> None:
    """The LTX-Video mask through `pictor_bf16` under `torch.compile(fullgraph=True)`: served as a key bias (the
    decision a constant of the device, taken while tracing), not by native attention: the eager result, bit for
    bit, and no fallback warning."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    query, key, value, _ = token_major_qkv(2, 333, 1000, "wgmma", head_dim)
    kept = torch.arange(1000, device="cuda") < torch.tensor([[700], [1000]], device="cuda")
    mask = ((~kept).bfloat16() * -10000.0).view(2, 1, 1, 1000).expand(2, 4, 1, 1000).contiguous()
    eager = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="pictor_bf16")
    call = torch.compile(lambda *qkvm: dispatch_attention_fn(*qkvm[:3], attn_mask=qkvm[3], backend="pictor_bf16"),
                         fullgraph=True)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = call(query, key, value, mask)
        finally:
            torch._dynamo.reset()
    assert not [w for w in caught if "pictor-diffusers" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(out, eager)


def rel_l2_of(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return ((actual.double() - exact).norm() / exact.norm()).item()


def token_major_qkv(
    batch: int, seq_q: int, seq_k: int, kernel: str, head_dim: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Seeded N(0, 1) bf16 q `[B, Nq, 4, D]`, k, v `[B, Nk, 4, D]` on CUDA and their head-major contiguous
    copies; skips when `kernel` cannot run them here."""
    from pictor_diffusers.cuda.plan import cannot_run

    generator = torch.Generator(device="cuda").manual_seed(seq_q + seq_k)
    query = torch.randn(batch, seq_q, 4, head_dim, device="cuda", generator=generator).bfloat16()
    key, value = (torch.randn(batch, seq_k, 4, head_dim, device="cuda", generator=generator).bfloat16() for _ in "kv")
    head_major = [t.transpose(1, 2).contiguous() for t in (query, key, value)]
    reason = cannot_run(kernel, *head_major)
    if reason is not None:
        pytest.skip(f"the {kernel} kernel cannot run here: {reason}")
    return query, key, value, head_major


@HEAD_DIMS
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(2, 300, 300), (1, 4608, 4608), (2, 4096, 512)])
def test_bf16_backend_reads_token_major_in_place(batch: int, seq_q: int, seq_k: int, head_dim: int) -> None:
    """`pictor_bf16` on bf16 `[B, N, H, D]` hands the dispatcher's token-major tensors to the Hopper kernel
    as they are: the call allocates only its output, and the result is the head-major launch's, bit for bit."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from pictor_diffusers import attention

    query, key, value, head_major = token_major_qkv(batch, seq_q, seq_k, "wgmma", head_dim)
    expected = attention(*head_major).view(query.shape)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    out = dispatch_attention_fn(query, key, value, backend="pictor_bf16")
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert torch.equal(out, expected), "the token-major call differs from the head-major launch"
    assert allocations == 1, f"{allocations} allocations (expected the output only)"


EIGHT_BIT_REL_L2 = 0.06
"""The 8-bit scheme's bound against float64 on N(0, 1) inputs (the kernel measures 3.5e-2 to 4.9e-2)."""


@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(2, 300, 300), (1, 4608, 4608), (2, 4096, 512)])
def test_fp8_backend_runs_the_8bit_kernel(batch: int, seq_q: int, seq_k: int) -> None:
    """`pictor_fp8` on bf16 `[B, N, H, 128]`: the "fp8" precision's kernel's result on head-major copies, bit for
    bit, within the 8-bit bound of float64; at head_dim 64 (no 8-bit build) `pictor_bf16`'s result."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from pictor_diffusers import attention

    kernel = PRECISIONS["fp8"].kernel
    query, key, value, head_major = token_major_qkv(batch, seq_q, seq_k, kernel)
    out = dispatch_attention_fn(query, key, value, backend="pictor_fp8")
    assert torch.equal(out, attention(*head_major, kernel=kernel).view(query.shape))
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in head_major)).transpose(1, 2)
    assert rel_l2(out, exact) <= EIGHT_BIT_REL_L2
    narrow = [t[..., :64].contiguous() for t in (query, key, value)]
    with warnings.catch_warnings():  # the fallback's warning is tested on CPU (test_backend_fp8.py)
        warnings.simplefilter("ignore")
        fallback = dispatch_attention_fn(*narrow, backend="pictor_fp8")
    assert torch.equal(fallback, dispatch_attention_fn(*narrow, backend="pictor_bf16"))


def test_fp8_backend_compiles_to_its_eager_result() -> None:
    """`torch.compile(fullgraph=True)` through `pictor_fp8` on CUDA (the backend decides from the head_dim
    alone there: resolving a kernel reads data pointers) gives the eager call's result, bit for bit."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    query, key, value, _ = token_major_qkv(1, 300, 300, PRECISIONS["fp8"].kernel)
    compiled = torch.compile(lambda q, k, v: dispatch_attention_fn(q, k, v, backend="pictor_fp8"), fullgraph=True)
    try:
        out = compiled(query, key, value)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, dispatch_attention_fn(query, key, value, backend="pictor_fp8"))
