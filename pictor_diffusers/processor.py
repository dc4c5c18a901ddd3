"""`PictorAttn`: one diffusers attention processor for every FLUX.2 attention.

    transformer.set_attn_processor(PictorAttn())

serves both module types of `Flux2Transformer2DModel`:

* `Flux2Attention` (double-stream blocks): separate or fused
  (`fuse_qkv_projections()`) Q/K/V projections for image and text tokens;
* `Flux2ParallelSelfAttention` (single-stream blocks): QKV fused with the MLP
  input projection, attention and MLP outputs projected together.

The math is that of diffusers' stock `Flux2AttnProcessor` /
`Flux2ParallelSelfAttnProcessor`: projections, QK RMSNorm, [text, image] token
order, RoPE, attention, cast back to the model dtype, output projections. The
difference is precision: after the projections and QK norms, RoPE and
attention run in float32 whatever the model dtype (the parity contract), on
CUDA through pictor's kernel and on CPU through its pure-torch twin.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2Attention, Flux2ParallelSelfAttention

from .ops import attention

Rope = tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate `x` `[B, N, H, D]` by diffusers' interleaved-pair RoPE, in float32.

    `rope` is `(cos, sin)`, each `[N, D]`, as FLUX.2's `Flux2PosEmbed` returns
    them: pair (x[2i], x[2i+1]) maps to (x[2i] cos - x[2i+1] sin,
    x[2i+1] cos + x[2i] sin) with cos/sin repeated per pair.
    """
    cos, sin = (t.to(device=x.device, dtype=torch.float32)[None, :, None, :] for t in rope)
    x = x.float()
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((-imag, real), dim=-1).flatten(-2)
    return x * cos + rotated * sin


def attend_token_major(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rope: Rope | None) -> torch.Tensor:
    """RoPE, head-major f32 layout, attention, cast back.

    Args:
        query, key, value: token-major `[B, N, H, D]` in the model dtype
            (after the QK norms).
        rope: FLUX.2's `(cos, sin)`, each `[N, D]`, or None.

    Returns:
        `[B, N, H*D]` in the dtype of `query`.
    """
    dtype = query.dtype
    if rope is not None:
        query = apply_rope(query, rope)
        key = apply_rope(key, rope)
    heads_major = [t.float().transpose(1, 2).contiguous() for t in (query, key, value)]
    return attention(*heads_major).to(dtype)


def _split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def _double_stream_projections(
    attn: Flux2Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Image q, k, v and, with text tokens, text q, k, v; each `[B, N, inner_dim]`."""
    if getattr(attn, "fused_projections", False):
        image_qkv = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        if encoder_hidden_states is None:
            return image_qkv
        return image_qkv + attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
    image_qkv = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
    if encoder_hidden_states is None:
        return image_qkv
    text_qkv = (
        attn.add_q_proj(encoder_hidden_states),
        attn.add_k_proj(encoder_hidden_states),
        attn.add_v_proj(encoder_hidden_states),
    )
    return image_qkv + text_qkv


class PictorAttn:
    """Attention processor for FLUX.2 that runs pictor's f32 attention kernel.

    Serves `Flux2Attention` and `Flux2ParallelSelfAttention`; anything else,
    an attention mask, FLUX.2's reference-image KV cache, or an unknown
    keyword raises an error that names it. CUDA tensors need CuPy (the
    `cuda12` / `cuda13` extras); CPU tensors run the pure-torch twin of the
    kernel. Inference only: the kernel has no backward.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        *args: Any,
        kv_cache: Any = None,
        kv_cache_mode: str | None = None,
        num_txt_tokens: int = 0,
        num_ref_tokens: int = 0,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if kwargs:
            raise TypeError(f"PictorAttn does not understand the attention kwargs {sorted(kwargs)}")
        if kv_cache_mode is not None or kv_cache is not None:
            raise NotImplementedError(
                f"PictorAttn does not serve FLUX.2 reference-image KV caching (kv_cache_mode={kv_cache_mode!r}); "
                "use diffusers' Flux2KV processors for that mode"
            )
        if isinstance(attn, Flux2ParallelSelfAttention):
            return self._single_stream(attn, hidden_states, *args)
        if isinstance(attn, Flux2Attention):
            return self._double_stream(attn, hidden_states, *args)
        raise TypeError(f"PictorAttn serves Flux2Attention and Flux2ParallelSelfAttention, not {type(attn).__name__}")

    @staticmethod
    def _reject_mask(attention_mask: torch.Tensor | None) -> None:
        if attention_mask is not None:
            raise ValueError(
                "PictorAttn computes unmasked attention, as FLUX.2 uses it; got an attention_mask "
                f"of shape {tuple(attention_mask.shape)}"
            )

    def _double_stream(
        self,
        attn: Flux2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rope | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self._reject_mask(attention_mask)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is None:
            raise ValueError(
                "this Flux2Attention has no text projections (added_kv_proj_dim=None) but got encoder_hidden_states"
            )
        projections = _double_stream_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value = (_split_heads(t, attn.head_dim) for t in projections[:3])
        query, key = attn.norm_q(query), attn.norm_k(key)
        if encoder_hidden_states is not None:
            text_query, text_key, text_value = (_split_heads(t, attn.head_dim) for t in projections[3:])
            text_query, text_key = attn.norm_added_q(text_query), attn.norm_added_k(text_key)
            query = torch.cat([text_query, query], dim=1)
            key = torch.cat([text_key, key], dim=1)
            value = torch.cat([text_value, value], dim=1)

        hidden_states = attend_token_major(query, key, value, image_rotary_emb)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [text_len, hidden_states.shape[1] - text_len], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states

    def _single_stream(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Rope | None = None,
    ) -> torch.Tensor:
        self._reject_mask(attention_mask)
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_width = 3 * attn.inner_dim
        mlp_width = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_width // (qkv_width + mlp_width)
        qkv, mlp_hidden_states = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        query, key, value = (_split_heads(t, attn.head_dim) for t in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)

        attn_output = attend_token_major(query, key, value, image_rotary_emb)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([attn_output, mlp_hidden_states], dim=-1))
