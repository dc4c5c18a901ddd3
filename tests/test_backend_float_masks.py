"""Additive float masks through pictor's diffusers backends, on CPU.

* key-padding float masks (0 kept; -inf, finfo.min or -10000 dropped; the same over heads and queries) are served,
  in every broadcast form SDPA takes, LTX-Video's materialized `[B, H, 1, Nk]` included, as accurate as native
  against float64;
* any other float mask that is the same for every query row (varying over heads, positive or small negative
  biases, NaN, a batch keeping no key) is served too, as a key bias (`mask_bias`: the CPU twins and the Hopper
  kernel add it to the logits), against float64 SDPA, NaN where SDPA gives NaN;
* a mask that varies over queries runs native, bitwise, with one warning naming the mask's dtype and shape;
* a tiny LTX-Video transformer with a padded prompt: every call served, no warning, output as native's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from diffusers import LTXVideoTransformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from test_backend import (
    COMPUTE,
    DTYPES,
    NAMES,
    assert_masked_call_served,
    compare_backend,
    pictor_warnings,
    qkv,
    sdpa64,
)
from test_flux1 import count_pictor_calls, rel_l2

from pictor_diffusers.integration.key_padding import DROPPED_AT

HEADS = 2
DROPPED = {"-inf": lambda dtype: float("-inf"), "finfo.min": lambda dtype: torch.finfo(dtype).min,
           "-10000": lambda dtype: -10000.0}  # fmt: skip
FORMS = {"1xNk": lambda b, h, n: (1, n), "Hx1xNk": lambda b, h, n: (h, 1, n), "Bx1x1xNk": lambda b, h, n: (b, 1, 1, n),
         "1xHx1xNk": lambda b, h, n: (1, h, 1, n), "BxHx1xNk": lambda b, h, n: (b, h, 1, n)}  # fmt: skip
"""Key-padding broadcast forms; the head dims are materialized (LTX repeats its mask over heads)."""


def kept_keys(batch: int, seq_k: int, pattern: str) -> torch.Tensor:
    """`[B, Nk]` bool, True: kept. "holes": holes in the middle and a padded tail, different per batch, each
    batch keeping at least its first two keys; "all": every key kept."""
    if pattern == "all":
        return torch.ones(batch, seq_k, dtype=torch.bool)
    kept = torch.rand(batch, seq_k, generator=torch.Generator().manual_seed(3)) > 0.4
    kept[:, :2] = True
    for b in range(batch):
        kept[b, seq_k - 1 - 7 * b :] = False
    return kept


def float_mask(kept: torch.Tensor, form: str, dropped: float, dtype: torch.dtype) -> torch.Tensor:
    """`kept` `[B, Nk]` as an additive mask of `dtype` (0 kept, `dropped` not) in broadcast `form`."""
    batch, seq_k = kept.shape
    shape = FORMS[form](batch, HEADS, seq_k)
    rows = kept[: shape[0]] if len(shape) == 4 else kept[:1]
    values = torch.zeros(rows.shape, dtype=dtype).masked_fill(~rows, dropped)
    return values.reshape(rows.shape[0], *[1] * (len(shape) - 2), seq_k).expand(shape).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dropped", list(DROPPED))
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("pattern", ["holes", "all"])
@pytest.mark.parametrize(("batch", "seq_q", "seq_k"), [(3, 21, 300), (2, 130, 131)])
def test_key_padding_float_masks_served(
    batch: int, seq_q: int, seq_k: int, pattern: str, form: str, dropped: str, dtype: torch.dtype, monkeypatch
) -> None:
    query = qkv((batch, seq_q, HEADS, 32), dtype, seed=4)[0]
    key, value = qkv((batch, seq_k, HEADS, 32), dtype, seed=5)[:2]
    mask = float_mask(kept_keys(batch, seq_k, pattern), form, DROPPED[dropped](dtype), dtype)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=mask.double()
    ).transpose(1, 2)
    if pattern == "holes":
        assert rel_l2(exact, sdpa64(query, key, value)) > 1e-2, "the mask changes nothing: the check would be vacuous"
    assert_masked_call_served(query, key, value, mask, exact, monkeypatch)


def not_key_padding(case: str, dtype: torch.dtype) -> torch.Tensor:
    """A float mask for q `[2, 20, HEADS, 16]`, k `[2, 24, HEADS, 16]` that is not key padding, by case."""
    kept = kept_keys(2, 24, "holes")
    mask = float_mask(kept, "BxHx1xNk", float("-inf"), torch.float32)
    if case == "over-queries":  # a causal-like pattern
        mask = torch.zeros(20, 24).masked_fill(torch.ones(20, 24, dtype=torch.bool).triu(5), float("-inf"))
    elif case == "over-heads":  # key 0 is kept, but not by head 1
        mask[1, 1, 0, 0] = float("-inf")
    elif case == "positive-bias":
        mask[:, :, :, 5] = 0.5
    elif case == "finite-bias":
        mask[:, :, :, 3] = -5.0
    elif case == "just-above-threshold":
        mask[0, :, :, 4] = DROPPED_AT / 2
    elif case == "nan":
        mask[1, :, :, 0] = float("nan")
    elif case == "no-key-kept":  # finite: native weighs every key alike
        mask[1] = -10000.0
    return mask.to(dtype)


PER_KEY_BIASES = "over-heads positive-bias finite-bias just-above-threshold nan no-key-kept".split()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PER_KEY_BIASES)
def test_per_key_biases_served_as_key_bias(case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float masks that are not key padding but the same for every query row: served by every backend, NaN
    exactly where float64 SDPA gives NaN (the "nan" case's batch), elsewhere as accurate as native."""
    query = qkv((2, 20, HEADS, 16), dtype, seed=6)[0]
    key, value = qkv((2, 24, HEADS, 16), dtype, seed=7)[:2]
    mask = not_key_padding(case, dtype)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=mask.double()
    ).transpose(1, 2)
    nan = exact.isnan()
    assert nan.any() == (case == "nan")
    if nan.any():
        for name in COMPUTE:
            out = dispatch_attention_fn(query, key, value, attn_mask=mask, backend=name)
            assert torch.equal(out.isnan(), nan), name
        query, key, value, mask, exact = query[:1], key[:1], value[:1], mask[:1], exact[:1]  # the finite batch
    assert_masked_call_served(query, key, value, mask, exact, monkeypatch)


@pytest.mark.parametrize("case", ["finite-bias", "no-key-kept"])
def test_without_a_key_bias_only_key_padding_is_served(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel takes no key bias (another GPU, the 8-bit kernels, torch.compile: `takes_key_bias` False),
    a key-padding float mask is still served, as key counts, and a per-key bias falls back with one warning."""
    from pictor_diffusers.integration import dispatcher_call

    monkeypatch.setattr(dispatcher_call, "takes_key_bias", lambda *args: False)
    query = qkv((2, 20, HEADS, 16), torch.float32, seed=6)[0]
    key, value = qkv((2, 24, HEADS, 16), torch.float32, seed=7)[:2]
    padding = float_mask(kept_keys(2, 24, "holes"), "BxHx1xNk", float("-inf"), torch.float32)
    exact = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (query, key, value)), attn_mask=padding.double()
    ).transpose(1, 2)
    assert_masked_call_served(query, key, value, padding, exact, monkeypatch)
    mask = not_key_padding(case, torch.float32)
    with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch_attention_fn(query, key, value, attn_mask=mask, backend="pictor")
    assert calls[0] == 0 and len(pictor_warnings(caught)) <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_masks_over_queries_fall_back(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    query = qkv((2, 20, HEADS, 16), dtype, seed=6)[0]
    key, value = qkv((2, 24, HEADS, 16), dtype, seed=7)[:2]
    mask = not_key_padding("over-queries", dtype)
    expected = dispatch_attention_fn(query, key, value, attn_mask=mask, backend="native")
    with count_pictor_calls(monkeypatch) as calls, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [dispatch_attention_fn(query, key, value, attn_mask=mask, backend=name) for _ in range(2)]
    assert calls[0] == 0
    messages = pictor_warnings(caught)
    assert len(messages) == 1 and "native attention" in messages[0] and name in messages[0], messages
    assert f"attn_mask {dtype} {tuple(mask.shape)}" in messages[0], messages[0]
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def ltx_inputs(batch: int, text_len: int, padded: bool, dtype: torch.dtype) -> dict:
    """Inputs of the tiny LTX-Video transformer in `dtype`: 2 x 4 x 5 latent tokens, a prompt padded (or not) to a
    different length per batch (its 0/1 long mask, as LTX's pipeline passes it)."""
    generator = torch.Generator().manual_seed(8)
    prompt_mask = torch.ones(batch, text_len, dtype=torch.long)
    if padded:
        for b in range(batch):
            prompt_mask[b, 3 + 2 * b :] = 0
    return {
        "hidden_states": torch.randn(batch, 2 * 4 * 5, 8, generator=generator).to(dtype),
        "encoder_hidden_states": torch.randn(batch, text_len, 16, generator=generator).to(dtype),
        "timestep": torch.tensor([500, 20][:batch]),
        "encoder_attention_mask": prompt_mask,
        "num_frames": 2,
        "height": 4,
        "width": 5,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(COMPUTE))
def test_ltx_video_mask_served(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """LTX-Video turns the prompt mask into `(1 - mask) * -10000` in the model's dtype, repeated over heads: its
    cross-attention hands the backend a `[B, H, 1, Nk]` float mask."""
    torch.manual_seed(0)
    config = {"in_channels": 8, "out_channels": 8, "num_attention_heads": HEADS, "attention_head_dim": 16,
              "cross_attention_dim": 32, "num_layers": 2, "caption_channels": 16}  # fmt: skip
    model = LTXVideoTransformer3DModel(**config).eval()
    with torch.no_grad():
        exact = model.double()(**ltx_inputs(2, 11, True, torch.float64))[0]
        unpadded = model(**ltx_inputs(2, 11, False, torch.float64))[0]
    assert rel_l2(unpadded, exact) > 1e-3, "the prompt mask changes nothing: the check would be vacuous"
    inputs = ltx_inputs(2, 11, True, dtype)
    native, out, calls, messages = compare_backend(model.to(dtype), inputs, name, monkeypatch, False)
    assert calls == 2 * config["num_layers"] and not messages, messages  # self- and masked cross-attention
    error, native_error = rel_l2(out, exact), rel_l2(native, exact)
    bound = 1e-5 if COMPUTE[name] == dtype == torch.float32 else 1.5 * native_error + 1e-3
    assert error <= bound, f"{name} {dtype}: {error:.3e} > {bound:.3e} (native {native_error:.3e})"


def test_key_bias_under_torch_compile_fullgraph() -> None:
    """On CPU a per-key float mask reaches pictor's custom op as a key bias under torch.compile(fullgraph=True):
    no graph break, the eager result bit for bit."""
    query = qkv((2, 20, HEADS, 16), torch.float32, seed=6)[0]
    key, value = qkv((2, 24, HEADS, 16), torch.float32, seed=7)[:2]
    mask = not_key_padding("finite-bias", torch.float32)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return dispatch_attention_fn(q, k, v, attn_mask=m, backend="pictor")

    eager = call(query, key, value, mask)
    compiled = torch.compile(call, fullgraph=True)(query, key, value, mask)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_key_bias_build_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """`mask_bias._has_key_bias_builds` (the CUDA answer of `takes_key_bias`, a constant under torch.compile)
    asks `resolve` for "auto" with a key bias in the compute dtype, for long and short key sequences, aligned
    rows (unaligned ones are copied), and is True only where a kernel build takes both; on the CPU the twins
    always do, and the 8-bit kernels never."""
    from types import SimpleNamespace

    from pictor_diffusers.cuda.selection import NoKernelError
    from pictor_diffusers.integration import mask_bias

    asked = []

    def resolve(kernel, in_dtype, out_dtype, head_dim, device_index, aligned, short_keys=False, key_bias=False):
        asked.append((kernel, in_dtype, out_dtype, head_dim, device_index, aligned, short_keys, key_bias))
        if head_dim == 96:
            raise NoKernelError("no build")
        served = head_dim == 128 or not short_keys
        return SimpleNamespace(selection=SimpleNamespace(variant=object() if served else None))

    monkeypatch.setattr(mask_bias, "resolve", resolve)
    answers = [mask_bias._has_key_bias_builds(compute, d, 1) for compute, d in (("bfloat16", 128), ("float16", 64))]
    assert answers == [True, False] and not mask_bias._has_key_bias_builds("float16", 96, 0)
    long, short = (("auto", torch.bfloat16, torch.bfloat16, 128, 1, True, s, True) for s in (False, True))
    assert asked[:2] == [long, short] and asked[2][1:3] == (torch.float16, torch.float16)
    assert mask_bias._BIAS_HEAD_DIMS == (64, 128)
    tensors = qkv((1, 8, HEADS, 16), torch.float32, seed=1)
    assert mask_bias.takes_key_bias("auto", torch.bfloat16, tensors)
    assert not mask_bias.takes_key_bias("fp8", torch.bfloat16, tensors)
    assert len(asked) == 5, "the CPU answer needs no kernel"
