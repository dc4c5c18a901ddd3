"""The layers `bench_layers.py` times, each one call at full size in bf16 (or tiny, for the CPU test), and their
outputs against a float64-attention reference.

A `Layer`'s `native()` runs the layer as diffusers does (through the attention dispatcher, native backend, unless
its `note` says it bypasses it); `backend_call(layer, name)` runs it on pictor backend `name`. The reference is the
same call with every `F.scaled_dot_product_attention` computed in float64 (`float64_sdpa`): the layers' own bf16
rounding stays, so the errors are attention's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple
from unittest import mock

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import attention_backend, dispatch_attention_fn
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoTransformerBlock
from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from pictor_diffusers import attention
from pictor_diffusers.integration.backend import BACKENDS as PICTOR_BACKENDS
from pictor_diffusers.testing.models import TINY_FLUX1_CONFIG, build_flux1_transformer, flux1_transformer_inputs
from pictor_diffusers.testing.references import rel_l2

BACKENDS = ("pictor_bf16", "pictor")
DTYPE = torch.bfloat16
LOGITS_PER_BLOCK = 2**27
"""float64 logits per reference SDPA call (1 GiB): the reference runs over batches, heads and query blocks."""


class Layer(NamedTuple):
    """One timed call: `native()` -> output tensor; `pictor(name)`: the call on pictor backend `name` where the
    layer bypasses the dispatcher (else None: `native` under `attention_backend(name)`)."""

    native: Callable[[], torch.Tensor]
    pictor: Callable[[str], Callable[[], torch.Tensor]] | None = None
    note: str = ""
    whole_model: bool = False


def backend_call(layer: Layer, name: str) -> Callable[[], torch.Tensor]:
    """`layer`'s call on pictor backend `name`."""
    if layer.pictor is not None:
        return layer.pictor(name)

    def call() -> torch.Tensor:
        with attention_backend(name):
            return layer.native()

    return call


@contextmanager
def float64_sdpa() -> Iterator[None]:
    """Within: `F.scaled_dot_product_attention` (what diffusers' native backend and bypassing processors call)
    computes in float64, in blocks of `LOGITS_PER_BLOCK` logits, and returns the query's dtype."""
    sdpa = F.scaled_dot_product_attention

    def exact(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if dropout_p or is_causal or enable_gqa:
            raise ValueError("the float64 reference takes neither dropout, is_causal nor grouped-query heads")
        batch, heads, seq_q, _ = query.shape
        mask = None if attn_mask is None else attn_mask.expand(batch, heads, seq_q, key.shape[-2])
        out = torch.empty_like(query)
        rows = max(1, LOGITS_PER_BLOCK // key.shape[-2])
        for b in range(batch):
            for h in range(heads):
                k, v = key[b, h].double(), value[b, h].double()
                for start in range(0, seq_q, rows):
                    part = slice(start, start + rows)
                    block = None if mask is None else mask[b, h, part]
                    block = block.double() if block is not None and block.is_floating_point() else block
                    out[b, h, part] = sdpa(query[b, h, part].double(), k, v, attn_mask=block, scale=scale)
        return out

    with mock.patch.object(F, "scaled_dot_product_attention", exact):
        yield


@torch.no_grad()
def layer_outputs(layer: Layer, backends: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{"float64": the reference, "native": native's output, backend: its output} of one call each."""
    with float64_sdpa():
        outputs = {"float64": layer.native()}
    outputs["native"] = layer.native()
    for name in backends:
        outputs[name] = backend_call(layer, name)()
    return outputs


def errors(outputs: dict[str, torch.Tensor]) -> dict[str, float]:
    """`{name}_rel_l2_vs_float64` for native and each backend, and `{backend}_rel_l2_vs_native`."""
    exact, native = outputs["float64"], outputs["native"]
    row = {f"{name}_rel_l2_vs_float64": rel_l2(out, exact) for name, out in outputs.items() if name != "float64"}
    row.update({f"{name}_rel_l2_vs_native": rel_l2(out, native) for name, out in outputs.items() if name in BACKENDS})
    return row


def _randn(*shape: int, device: str, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, DTYPE)


def wan_layers(device: str, tiny: bool, tokens: int) -> dict[str, Layer]:
    """A Wan2.1-14B block's self-attention (5120 wide, 40 heads of 128) over `tokens` video tokens, and its text
    cross-attention (video over 512 text tokens), projections included."""
    heads, head_dim, text = (2, 16, 7) if tiny else (40, 128, 512)
    torch.manual_seed(0)
    layer = {"dim": heads * head_dim, "heads": heads, "dim_head": head_dim, "eps": 1e-6}
    self_attn = WanAttention(**layer, processor=WanAttnProcessor()).to(device, DTYPE).eval()
    cross_attn = WanAttention(**layer, cross_attention_dim_head=head_dim, processor=WanAttnProcessor())
    cross_attn = cross_attn.to(device, DTYPE).eval()
    video = _randn(1, tokens, heads * head_dim, device=device, seed=0)
    words = _randn(1, text, heads * head_dim, device=device, seed=1)
    return {"wan-self": Layer(lambda: self_attn(video)), "wan-cross": Layer(lambda: cross_attn(video, words))}


def qwen_masked(device: str, tiny: bool) -> Layer:
    """Qwen-Image's joint attention call (B2, 24 heads of 128, [256 text | 4096 image]), batch 1's text padded
    to 97 tokens: its bool `[B, 1, 1, Nk]` key-padding mask."""
    text, kept, image, heads, head_dim = (8, 3, 40, 2, 16) if tiny else (256, 97, 4096, 24, 128)
    query, key, value = (_randn(2, text + image, heads, head_dim, device=device, seed=s) for s in range(3))
    mask = torch.ones(2, 1, 1, text + image, dtype=torch.bool, device=device)
    mask[1, ..., kept:text] = False
    return Layer(lambda: dispatch_attention_fn(query, key, value, attn_mask=mask))


def ltx_block(device: str, tiny: bool) -> Layer:
    """An LTX-Video transformer block (2048 wide, 32 heads of 64; RoPE left out): self-attention over 6144 video
    tokens, then cross-attention to 128 text tokens under LTX's float mask, `(1 - mask) * -10000` in bf16 (B2:
    prompts of 128 and 20 real tokens), which its processor repeats to `[B, 32, 1, 128]`."""
    heads, head_dim, tokens, text = (2, 16, 40, 11) if tiny else (32, 64, 6144, 128)
    dim = heads * head_dim
    torch.manual_seed(0)
    block = LTXVideoTransformerBlock(dim, heads, head_dim, cross_attention_dim=dim).to(device, DTYPE).eval()
    video, words = _randn(2, tokens, dim, device=device, seed=0), _randn(2, text, dim, device=device, seed=1)
    temb = _randn(2, 1, 6 * dim, device=device, seed=2)
    prompt = torch.ones(2, text, device=device)
    prompt[1, text * 5 // 32 :] = 0
    mask = ((1 - prompt.to(DTYPE)) * -10000.0).unsqueeze(1)
    return Layer(lambda: block(video, words, temb, encoder_attention_mask=mask))


def sd35_joint(device: str, tiny: bool) -> Layer:
    """SD3.5's joint attention (B2 for guidance, 24 heads of 64, 4096 image + 333 text tokens). Its
    `JointAttnProcessor2_0` calls `F.scaled_dot_product_attention` itself, bypassing the dispatcher: native is
    that SDPA call on head-major `[B, H, N, D]`, pictor is `pictor_diffusers.attention` on the same tensors."""
    heads, head_dim, tokens = (2, 16, 48) if tiny else (24, 64, 4096 + 333)
    query, key, value = (_randn(2, heads, tokens, head_dim, device=device, seed=s) for s in range(3))

    def pictor(name: str) -> Callable[[], torch.Tensor]:
        compute = PICTOR_BACKENDS[name].compute

        def call() -> torch.Tensor:
            qkv = (t.to(compute) for t in (query, key, value))
            out = attention(*qkv, out_dtype=DTYPE, kernel=PICTOR_BACKENDS[name].kernel)
            return out.unflatten(-1, (heads, head_dim)).transpose(1, 2)

        return call

    note = "JointAttnProcessor2_0 bypasses the dispatcher: F.scaled_dot_product_attention vs pictor's attention()"
    return Layer(lambda: F.scaled_dot_product_attention(query, key, value), pictor, note)


def hunyuan_block(device: str, tiny: bool) -> Layer:
    """A HunyuanVideo dual-stream block (3072 wide, 24 heads of 128; RoPE left out) over 11520 video + 256 text
    tokens, the text padded to 200 real tokens: the bool `[1, 1, 1, 11776]` mask its transformer builds."""
    heads, head_dim, tokens, text = (2, 16, 40, 8) if tiny else (24, 128, 11520, 256)
    dim = heads * head_dim
    torch.manual_seed(0)
    block = HunyuanVideoTransformerBlock(heads, head_dim, mlp_ratio=4.0).to(device, DTYPE).eval()
    video, words = _randn(1, tokens, dim, device=device, seed=0), _randn(1, text, dim, device=device, seed=1)
    temb = _randn(1, dim, device=device, seed=2)
    mask = torch.ones(1, 1, 1, tokens + text, dtype=torch.bool, device=device)
    mask[..., tokens + text * 25 // 32 :] = False
    return Layer(lambda: torch.cat(block(video, words, temb, mask), dim=1))


def flux1_transformer(device: str, tiny: bool) -> Layer:
    """The FLUX.1-dev transformer (random weights, bf16), one forward at 1024² (4096 image + 512 text tokens)."""
    model = build_flux1_transformer(TINY_FLUX1_CONFIG if tiny else None, device=device, dtype=DTYPE)
    inputs = flux1_transformer_inputs(model, 1, (4, 4) if tiny else (64, 64), 8 if tiny else 512)
    return Layer(lambda: model(**inputs)[0], whole_model=True)


def layers(device: str, tiny: bool = False, wan_tokens: int = 32760) -> dict[str, Callable[[], Layer]]:
    """Each row's name -> its `Layer`'s builder (built one at a time: FLUX.1-dev alone holds 24 GB)."""
    wan = {name: (lambda name=name: wan_layers(device, tiny, wan_tokens)[name]) for name in ("wan-self", "wan-cross")}
    return {
        **wan,
        "qwen-masked": lambda: qwen_masked(device, tiny),
        "ltx-block": lambda: ltx_block(device, tiny),
        "sd35-joint": lambda: sd35_joint(device, tiny),
        "hunyuan-block": lambda: hunyuan_block(device, tiny),
        "flux1-dev": lambda: flux1_transformer(device, tiny),
    }
