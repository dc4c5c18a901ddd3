"""FLUX.1's `FluxAttention` on pictor: what `PictorAttn` runs for `FluxTransformer2DModel`.

The math and return structure are those of diffusers' stock `FluxAttnProcessor`:

* double-stream blocks (`added_kv_proj_dim` set, text given): image and text
  projections (separate, or fused by `fuse_qkv_projections()`), per-head QK
  RMSNorm, [text, image] join, RoPE, attention; returns
  `(to_out(image part), to_add_out(text part))`;
* single-stream blocks (`pre_only=True`, the joined tokens in, no text): the
  same without the join; returns the attention output `[B, N, H*D]` itself,
  unprojected (FLUX.1's block projects it together with its MLP branch). As in
  stock, any call without text returns it unprojected.

FLUX.1's RoPE is FLUX.2's: `FluxPosEmbed` returns (cos, sin), each `[N, D]`
with interleaved pairs, which stock applies by `apply_rotary_emb(...,
sequence_dim=1)`; `prologue.apply_rope` and the fused prologue kernel compute
the same rotation. Everything after the projections is `PictorAttn._attend`:
on CUDA the fused prologue kernel and the attention kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention

from .projections import joint_segments
from .prologue import Rope, Segment

Attend = Callable[[list[Segment], int, Rope | None], torch.Tensor]
"""`PictorAttn._attend`: (segments, head_dim, rope) -> token-major `[B, N, H*D]` in the projections' dtype."""


def flux1_attention(
    attend: Attend,
    attn: FluxAttention,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    image_rotary_emb: Rope | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One `FluxAttention` call through pictor.

    Args:
        attend: the processor's prologue + attention.
        attn: the module (its projections, QK norms and output projections).
        hidden_states: image tokens `[B, n_img, C]`, or all tokens for single blocks.
        encoder_hidden_states: text tokens `[B, n_txt, C_txt]`, or None.
        attention_mask: must be None (FLUX.1 uses none; pictor computes unmasked attention).
        image_rotary_emb: `(cos, sin)`, each `[n_txt + n_img, D]`, or None.

    Returns:
        `(image, text)` outputs `[B, n, C]` of the output projections with
        text, else the attention output `[B, N, H*D]`; model dtype throughout.
    """
    if attention_mask is not None:
        raise ValueError(
            "PictorAttn computes unmasked attention, as FLUX.1 uses it; got an attention_mask "
            f"of shape {tuple(attention_mask.shape)}"
        )
    segments = joint_segments(attn, hidden_states, encoder_hidden_states)
    hidden_states = attend(segments, attn.head_dim, image_rotary_emb)
    if encoder_hidden_states is None:
        return hidden_states

    text_len = encoder_hidden_states.shape[1]
    encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
        [text_len, hidden_states.shape[1] - text_len], dim=1
    )
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
    return hidden_states, attn.to_add_out(encoder_hidden_states)
