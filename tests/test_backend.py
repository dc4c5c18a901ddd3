"""pictor as a diffusers attention backend ("pictor", "pictor_bf16", "pictor_fp16"; fallbacks of all four), on CPU.

(Registration and diffusers-version robustness: `test_backend_registration.py`; "pictor_fp8":
`test_backend_fp8.py`.)

* direct calls through `dispatch_attention_fn`: float32 within 1e-5 of native;
  16-bit inputs as accurate as native SDPA; the op runs once per served call;
  Nq != Nk and the log-sum-exp against float64.
* fallbacks: each unsupported feature runs native (bitwise the same output),
  warns once naming it, and never runs pictor; with return_lse=True it raises.
* whole models: tiny FLUX.1 (served), Qwen-Image with a padding mask (served),
  Wan (self-attention and text cross-attention, Nq != Nk, served), HunyuanVideo
  with a full and a padded prompt (served), via `set_attention_backend` and the
  `attention_backend` context manager.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers import HunyuanVideoTransformer3DModel, QwenImageTransformer2DModel, WanTransformer3DModel
from diffusers.models import attention_dispatch as dispatch
from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend, dispatch_attention_fn
from test_flux1 import attention_modules, build_flux1, count_pictor_calls, flux1_inputs, rel_l2

from pictor_diffusers.integration.backend import BACKENDS

Registry = dispatch._AttentionBackendRegistry
NAMES = list(BACKENDS)
COMPUTE = {name: backend.compute for name, backend in BACKENDS.items() if backend.kernel == "auto"}
"""The backends held to native SDPA's accuracy, by compute dtype ("pictor_fp8" is lossy: its own tests)."""
SHAPES = [(1, 46, 2, 32), (2, 130, 3, 64), (1, 1, 1, 8), (1, 257, 2, 128)]  # [B, N, H, D]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def qkv(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(3)]


def sdpa64(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """float64 SDPA of `[B, N, H, D]` inputs, `[B, N, H, D]` out."""
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (query, key, value)))
    return out.transpose(1, 2)


def pictor_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "pictor-diffusers" in str(w.message)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_parity_direct(shape: tuple[int, ...], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    query, key, value = qkv(shape, dtype)
    exact, native = sdpa64(query, key, value), dispatch_attention_fn(query, key, value, backend="native")
    for name, compute in COMPUTE.items():
        with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dispatch_attention_fn(query, key, value, backend=name)
        assert calls[0] == 1 and not pictor_warnings(caught), f"{name} did not serve the call"
        assert out.shape == shape and out.dtype == dtype and out.is_contiguous()
        error = rel_l2(out, exact)
        if compute == torch.float32 and dtype == torch.float32:
            assert rel_l2(out, native) <= 1e-5
        elif compute == torch.float32:  # f32-accurate, rounded once: at least as good as native 16-bit SDPA
            assert error <= rel_l2(native, exact) + 1e-6, f"{name} {error:.3e} vs native {rel_l2(native, exact):.3e}"
        else:  # native SDPA on the same once-rounded inputs, returned in the same dtype
            rounded = dispatch_attention_fn(*(t.to(compute) for t in (query, key, value)), backend="native").to(dtype)
            bound = 1.5 * rel_l2(rounded, exact) + 1e-6
            assert error <= bound, f"{name} on {dtype}: {error:.3e} > {bound:.3e}"


@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(1, 70, 12), (2, 9, 131), (1, 1, 1)])
def test_unequal_lengths_and_lse(batch: int, seq_q: int, seq_k: int) -> None:
    query = qkv((batch, seq_q, 3, 32), seed=1)[0]
    key, value = qkv((batch, seq_k, 3, 32), seed=2)[:2]
    for name, compute in COMPUTE.items():
        out, lse = Registry._backends[AttentionBackendName(name)](query, key, value, return_lse=True)
        assert out.shape == query.shape and lse.shape == (batch, seq_q, 3) and lse.dtype == torch.float32
        exact_lse = torch.logsumexp(
            torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * 32**-0.5, dim=-1
        ).transpose(1, 2)
        rounding = 1e-5 if compute == torch.float32 else 1e-2
        assert rel_l2(out, sdpa64(query, key, value)) <= rounding, name
        assert (lse.double() - exact_lse).abs().max().item() <= rounding, name


def padding_mask(shape: tuple[int, ...], batch: int, seq_k: int) -> torch.Tensor:
    """A bool key-padding mask of `shape` (last dim Nk) with holes in the middle and at the end, different
    per batch where the shape has a batch dim; batch 1 (when present) keeps no key at all."""
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(batch, seq_k, generator=generator) > 0.4
    mask[:, :2] = True
    if batch > 1:
        mask[1] = False
    return mask[: shape[0]].reshape(shape)


MASK_SHAPES = {"1xNk": lambda b, n: (1, n), "1x1xNk": lambda b, n: (1, 1, n), "Bx1x1xNk": lambda b, n: (b, 1, 1, n),
               "1x1x1xNk": lambda b, n: (1, 1, 1, n)}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", list(MASK_SHAPES))
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(3, 21, 300), (2, 130, 131)])
def test_key_padding_masks_served(batch: int, seq_q: int, seq_k: int, form: str, dtype, monkeypatch) -> None:
    query = qkv((batch, seq_q, 2, 32), dtype, seed=4)[0]
    key, value = qkv((batch, seq_k, 2, 32), dtype, seed=5)[:2]
    mask = padding_mask(MASK_SHAPES[form](batch, seq_k), batch, seq_k)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=mask
    ).transpose(1, 2)
    assert rel_l2(exact, sdpa64(query, key, value)) > 1e-2, "the mask changes nothing: the check would be vacuous"
    assert_masked_call_served(query, key, value, mask, exact, monkeypatch)


def assert_masked_call_served(query, key, value, mask: torch.Tensor, exact: torch.Tensor, monkeypatch) -> None:
    """Each backend of `COMPUTE` serves q `[B, Nq, H, D]`, k, v `[B, Nk, H, D]` with `mask` once, without a
    warning, within 1e-5 of `exact` (float64 `[B, Nq, H, D]`) in float32 (or 1.5x native's error, where a mask
    of large values costs native float32 more), else within 1.5x native's error."""
    native = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native")
    native_error = rel_l2(native, exact)
    label = f"{mask.dtype} {tuple(mask.shape)} mask, {query.dtype} inputs"
    for name, compute in COMPUTE.items():
        with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=name)
        assert calls[0] == 1 and not pictor_warnings(caught), f"{name} did not serve the {label}"
        assert out.shape == query.shape and out.dtype == query.dtype
        error = rel_l2(out, exact)
        f32 = compute == query.dtype == torch.float32
        bound = max(1e-5, 1.5 * native_error) if f32 else 1.5 * native_error + 4e-3
        assert error <= bound, f"{name}, {label}: {error:.3e} > {bound:.3e}"


def fallback_case(reason: str) -> dict:
    """Keyword arguments for `dispatch_attention_fn` that pictor must not serve, by reason."""
    query, key, value = qkv((2, 20, 4, 16))
    call = {"query": query, "key": key, "value": value}
    if reason == "attn_mask":  # varies over queries: not a key-padding mask
        call["attn_mask"] = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 1, 20, 20)
    elif reason == "is_causal":
        call["is_causal"] = True
    elif reason == "dropout_p":
        call["dropout_p"] = 0.5
    elif reason == "heads":
        call["key"], call["value"], call["enable_gqa"] = key[:, :, :2], value[:, :, :2], True
    elif reason == "head_dim":
        call.update(zip(("query", "key", "value"), qkv((1, 9, 1, 392)), strict=True))
    elif reason == "dtype":
        call.update({name: t.double() for name, t in call.items()})
    elif reason == "scale":
        call["scale"] = -0.25
    elif reason == "autograd":
        call["query"] = query.clone().requires_grad_(True)
    return call


FALLBACK_REASONS = "attn_mask is_causal dropout_p heads head_dim dtype scale autograd".split()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reason", FALLBACK_REASONS)
def test_fallback_matches_native_and_warns_once(reason: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    call = fallback_case(reason)
    torch.manual_seed(5)
    expected = dispatch_attention_fn(**call, backend="native")
    with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = []
        for _ in range(2):
            torch.manual_seed(5)
            outs.append(dispatch_attention_fn(**call, backend=name))
    assert calls[0] == 0
    messages = pictor_warnings(caught)
    assert len(messages) == 1 and "native attention" in messages[0], messages
    assert name in messages[0]
    for out in outs:
        assert torch.equal(out, expected), f"{reason}: the fallback is not native's result"
    if reason == "autograd":
        outs[0].sum().backward()
        assert call["query"].grad is not None and torch.isfinite(call["query"].grad).all()


def test_fallback_with_lse_raises_naming_the_reason() -> None:
    query, key, value = qkv((1, 8, 2, 16))
    pictor = Registry._backends[AttentionBackendName.PICTOR]
    with pytest.raises(NotImplementedError, match=r"causal attention.*does not return the log-sum-exp"):
        pictor(query, key, value, is_causal=True, return_lse=True)


def compare_backend(model: torch.nn.Module, inputs: dict, name: str, monkeypatch, use_context: bool):
    """(native output, output through pictor backend `name`, pictor's served calls, pictor warnings)."""
    with torch.no_grad():
        native = model(**inputs)[0]
        with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if use_context:
                with attention_backend(name):
                    out = model(**inputs)[0]
            else:
                model.set_attention_backend(name)
                out = model(**inputs)[0]
                model.reset_attention_backend()
                Registry._active_backend = AttentionBackendName.NATIVE
    assert out.shape == native.shape and out.dtype == native.dtype and torch.isfinite(out).all()
    return native, out, calls[0], pictor_warnings(caught)


@pytest.mark.parametrize("use_context", [False, True], ids=["set_attention_backend", "attention_backend"])
@pytest.mark.parametrize(("batch", "latent_hw", "text_len"), [(1, (5, 7), 11), (2, (11, 12), 9)], ids=["46", "141"])
def test_flux1_served(batch, latent_hw, text_len, use_context: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_flux1()
    inputs = flux1_inputs(model, batch, latent_hw, text_len)
    native, out, calls, messages = compare_backend(model, inputs, "pictor", monkeypatch, use_context)
    assert calls == attention_modules(model) and not messages
    assert rel_l2(out, native) <= 1e-5
    with torch.no_grad(), count_pictor_calls(monkeypatch) as after:
        assert torch.equal(model(**inputs)[0], native)
    assert after[0] == 0, "the backend stayed active after reset / leaving the context"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flux1_low_precision(dtype: torch.dtype, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model32 = build_flux1()
    with torch.no_grad():
        reference = model32(**flux1_inputs(model32, 2, (5, 7), 11))[0]
    model = copy.deepcopy(model32).to(dtype)
    native, out, calls, _ = compare_backend(model, flux1_inputs(model, 2, (5, 7), 11), name, monkeypatch, False)
    assert calls == attention_modules(model)
    bound = 2.0 * rel_l2(native, reference) + 1e-4
    assert rel_l2(out, reference) <= bound


QWEN_CONFIG = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 4,
    "joint_attention_dim": 16,
    "guidance_embeds": False,
    "axes_dims_rope": (8, 4, 4),
}


def qwen_inputs(batch: int, masked: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, 9, dtype=torch.long)
    mask[0, 6:] = 0
    return {
        "hidden_states": torch.randn(batch, 4 * 5, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, 9, 16, generator=generator),
        "encoder_hidden_states_mask": mask if masked else None,
        "timestep": torch.full((batch,), 1.0),
        "img_shapes": [(1, 4, 5)] * batch,
        "return_dict": False,
    }


@pytest.mark.parametrize("masked", [True, False], ids=["padding-mask", "no-mask"])
def test_qwen_image(masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**QWEN_CONFIG).eval()
    native, out, calls, messages = compare_backend(model, qwen_inputs(2, masked), "pictor", monkeypatch, False)
    assert calls == QWEN_CONFIG["num_layers"] and not messages
    assert rel_l2(out, native) <= 1e-5
    if masked:
        with torch.no_grad():
            unmasked = model(**qwen_inputs(2, False))[0]
        assert rel_l2(unmasked, native) > 1e-3, "the padding mask changes nothing: the check would be vacuous"


WAN_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


@pytest.mark.parametrize("use_context", [False, True], ids=["set_attention_backend", "attention_backend"])
def test_wan_self_and_cross_attention_served(use_context: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = WanTransformer3DModel(**WAN_CONFIG).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 10, 14, generator=generator),  # 2 x 5 x 7 = 70 tokens
        "encoder_hidden_states": torch.randn(1, 12, 16, generator=generator),
        "timestep": torch.tensor([500]),
        "return_dict": False,
    }
    native, out, calls, messages = compare_backend(model, inputs, "pictor", monkeypatch, use_context)
    assert calls == 2 * WAN_CONFIG["num_layers"], "pictor must serve every self- and cross-attention (Nq=70, Nk=12)"
    assert not messages
    assert rel_l2(out, native) <= 1e-5


HUNYUAN_VIDEO_CONFIG = {
    "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 10, "num_layers": 1,
    "num_single_layers": 2, "num_refiner_layers": 1, "patch_size": 1, "patch_size_t": 1, "guidance_embeds": True,
    "text_embed_dim": 16, "pooled_projection_dim": 8, "rope_axes_dim": (2, 4, 4), "image_condition_type": None,
}  # fmt: skip


@pytest.mark.parametrize("padded", [False, True], ids=["full-prompt", "padded-prompt"])
def test_hunyuan_video_served(padded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """HunyuanVideo's dual- and single-stream blocks on the dispatcher (80 video + 12 text tokens), its prompt mask
    a `[B, 1, 1, N]` bool key-padding mask: every call served, no warning, as native within 1e-5 (its token
    refiner calls SDPA itself, past the dispatcher)."""
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel(**HUNYUAN_VIDEO_CONFIG).eval()
    generator = torch.Generator().manual_seed(2)
    prompt = torch.ones(2, 12)
    if padded:
        prompt[1, 7:] = 0
    inputs = {
        "hidden_states": torch.randn(2, 4, 1, 8, 10, generator=generator),
        "timestep": torch.tensor([10.0, 500.0]),
        "encoder_hidden_states": torch.randn(2, 12, 16, generator=generator),
        "pooled_projections": torch.randn(2, 8, generator=generator),
        "encoder_attention_mask": prompt,
        "guidance": torch.tensor([3000.0, 3000.0]),
        "return_dict": False,
    }
    native, out, calls, messages = compare_backend(model, inputs, "pictor", monkeypatch, True)
    layers = HUNYUAN_VIDEO_CONFIG["num_layers"] + HUNYUAN_VIDEO_CONFIG["num_single_layers"]
    assert calls == layers and not messages
    assert rel_l2(out, native) <= 1e-5
    if padded:
        with torch.no_grad():
            full = model(**{**inputs, "encoder_attention_mask": torch.ones(2, 12)})[0]
        assert rel_l2(full, native) > 1e-3, "the padding changes nothing: the check would be vacuous"


def test_profiler_shows_pictor() -> None:
    model = build_flux1()
    inputs = flux1_inputs(model, 1, (5, 7), 11)
    model.set_attention_backend("pictor")
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(**inputs)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("pictor::attention") == attention_modules(model), sorted(k for k in counts if "::" in k)
