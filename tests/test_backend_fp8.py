"""The "pictor_fp8" diffusers backend on CPU: the 8-bit kernel's torch twin where it can run, the 16-bit path
(one warning naming why) where it cannot.

* served calls (head_dim 128, any of f32/bf16/f16 in): one pictor call, no warning, the result of
  `attention(kernel=KERNEL)` (the "fp8" precision's kernel) on the once-rounded bf16 inputs, within the 8-bit
  bound of float64;
* Nq != Nk with the log-sum-exp (the 8-bit kernel's, against `attention(kernel=KERNEL, return_lse=True)`),
  and boolean key-padding masks, at head_dim 128;
* another head_dim: the "pictor_bf16" result, one warning naming the head_dim;
* a tiny FLUX.1 whose head_dim is 128 through `set_attention_backend("pictor_fp8")`;
* under `torch.compile(fullgraph=True)`, the same choice as eager at head_dim 128 and 64.
Where a check could not tell the 8-bit kernel from the 16-bit path, it also asks for the 8-bit scheme's
distance from "pictor_bf16"'s result (the 16-bit path is ~20x closer to float64).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn
from test_backend import Registry, padding_mask, pictor_warnings, qkv, sdpa64
from test_flux1 import TINY_FLUX1, attention_modules, build_flux1, count_pictor_calls, flux1_inputs, rel_l2

from pictor_diffusers import attention
from pictor_diffusers.integration.precision import PRECISIONS

KERNEL = PRECISIONS["fp8"].kernel
EIGHT_BIT_REL_L2 = 0.06
"""The 8-bit scheme's relative L2 error bound on N(0, 1) inputs (measured here: 3.5e-2 to 3.8e-2)."""
EIGHT_BIT_FROM_BF16 = 1e-2
"""The least distance of an 8-bit attention result from the 16-bit path's (measured ~3.5e-2 on N(0, 1))."""
SHAPES = [(1, 257, 2, 128), (2, 70, 3, 128), (1, 1, 1, 128)]  # [B, N, H, D]; 257: not a multiple of 128
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def served(monkeypatch: pytest.MonkeyPatch, **call) -> tuple[torch.Tensor, int, list[str]]:
    """(output, pictor calls, pictor warnings) of one `dispatch_attention_fn` call on "pictor_fp8"."""
    with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = dispatch_attention_fn(**call, backend="pictor_fp8")
    return out, calls[0], pictor_warnings(caught)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_head_dim_128_runs_the_8bit_kernel(shape, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    query, key, value = qkv(shape, dtype)
    out, calls, messages = served(monkeypatch, query=query, key=key, value=value)
    assert calls == 1 and not messages, messages
    assert out.shape == shape and out.dtype == dtype
    batch, seq, heads, head_dim = shape
    rounded = (t.to(torch.bfloat16).transpose(1, 2).contiguous() for t in (query, key, value))
    twin = attention(*rounded, kernel=KERNEL).to(dtype).view(batch, seq, heads, head_dim)
    assert rel_l2(out, twin) <= 1e-4, "not the 8-bit kernel's result"
    assert rel_l2(out, sdpa64(query, key, value)) <= EIGHT_BIT_REL_L2


@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(1, 70, 12), (2, 9, 131)])
def test_unequal_lengths_and_lse(batch: int, seq_q: int, seq_k: int) -> None:
    query = qkv((batch, seq_q, 3, 128), seed=1)[0]
    key, value = qkv((batch, seq_k, 3, 128), seed=2)[:2]
    out, lse = Registry._backends[AttentionBackendName("pictor_fp8")](query, key, value, return_lse=True)
    assert out.shape == query.shape and lse.shape == (batch, seq_q, 3) and lse.dtype == torch.float32
    head_major = (t.to(torch.bfloat16).transpose(1, 2).contiguous() for t in (query, key, value))
    twin, twin_lse = attention(*head_major, kernel=KERNEL, return_lse=True)
    assert rel_l2(out, twin.float().view(query.shape)) <= 1e-4 and torch.equal(lse, twin_lse)
    logits = torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * 128**-0.5
    exact_lse = torch.logsumexp(logits, dim=-1).transpose(1, 2)
    assert rel_l2(out, sdpa64(query, key, value)) <= EIGHT_BIT_REL_L2
    # the LSE sums the rounded P (as the kernel's row-sum wgmma does): over 12 keys the rounding does not
    # average out (the twin measured 2.4e-2 to 2.7e-2 there; 1.3e-2 to 1.8e-2 with f32 sums); a missing q . mean
    # shift or a natural/log2 mix-up is off by > 0.1
    assert (lse.double() - exact_lse).abs().max().item() <= 3.5e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_key_padding_mask_served(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    batch, seq_q, seq_k = 3, 21, 300
    query = qkv((batch, seq_q, 2, 128), dtype, seed=4)[0]
    key, value = qkv((batch, seq_k, 2, 128), dtype, seed=5)[:2]
    mask = padding_mask((batch, 1, 1, seq_k), batch, seq_k)
    out, calls, messages = served(monkeypatch, query=query, key=key, value=value, attn_mask=mask)
    assert calls == 1 and not messages, messages
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=mask
    ).transpose(1, 2)
    kept = mask.reshape(batch, seq_k).any(dim=1)  # a batch with no key: SDPA gives NaN, pictor rows of 0
    assert torch.equal(out[~kept], torch.zeros_like(out[~kept]))
    assert rel_l2(out[kept], exact[kept]) <= EIGHT_BIT_REL_L2
    sixteen = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="pictor_bf16")
    assert rel_l2(out[kept], sixteen[kept]) >= EIGHT_BIT_FROM_BF16, "the 16-bit path's result, not the 8-bit one"


@pytest.mark.parametrize("head_dim", [64, 96], ids=lambda d: f"D{d}")
def test_other_head_dims_run_the_16bit_path(head_dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    query, key, value = qkv((2, 40, 2, head_dim), torch.bfloat16)
    out, calls, messages = served(monkeypatch, query=query, key=key, value=value)
    assert calls == 1 and len(messages) == 1, messages  # conftest clears warn_once's memory before each test
    assert f"head_dim={head_dim}" in messages[0] and "16-bit path" in messages[0], messages
    assert torch.equal(out, dispatch_attention_fn(query, key, value, backend="pictor_bf16"))


def test_flux1_through_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**TINY_FLUX1, "attention_head_dim": 128, "num_attention_heads": 2, "axes_dims_rope": (16, 56, 56)}
    model = build_flux1(config).to(torch.bfloat16)
    inputs = flux1_inputs(model, 1, (5, 7), 11)
    with torch.no_grad():
        native = model(**inputs)[0]
        model.set_attention_backend("pictor_fp8")
        with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(**inputs)[0]
        model.reset_attention_backend()
        model.set_attention_backend("pictor_bf16")
        sixteen = model(**inputs)[0]
        model.reset_attention_backend()
    assert calls[0] == attention_modules(model) and not pictor_warnings(caught)
    assert torch.isfinite(out).all() and rel_l2(out, native) <= 5e-2
    # the model's own bf16 rounding is the same size as the scheme's error here (fp8 vs pictor_bf16 2.8e-3,
    # pictor_bf16 vs native 2.2e-3), but the 16-bit path would give pictor_bf16's result exactly
    assert rel_l2(out, sixteen) >= 1e-3, "the 16-bit path's result, not the 8-bit one"


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own import
@pytest.mark.parametrize("head_dim", [128, 64], ids=lambda d: f"D{d}")
def test_compiled_call_makes_the_eager_choice(head_dim: int) -> None:
    """`torch.compile(fullgraph=True)` through "pictor_fp8": the 8-bit kernel at head_dim 128, the 16-bit
    path at 64 (without the warning, which dynamo cannot trace), each equal to its eager result."""
    query, key, value = qkv((1, 40, 2, head_dim), torch.bfloat16)
    compiled = torch.compile(lambda q, k, v: dispatch_attention_fn(q, k, v, backend="pictor_fp8"), fullgraph=True)
    try:
        out = compiled(query, key, value)
    finally:
        torch._dynamo.reset()
    eager = "pictor_fp8" if head_dim == 128 else "pictor_bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(out, dispatch_attention_fn(query, key, value, backend=eager))
