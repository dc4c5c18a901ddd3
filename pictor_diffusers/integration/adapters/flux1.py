"""FLUX.1's `FluxAttention`, as diffusers' stock `FluxAttnProcessor` runs it, for `FluxTransformer2DModel`.

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
the same rotation. FLUX.1 has no KV-cache mode.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux import FluxAttention

from .base import register_adapter
from .joint import JointAdapter


@register_adapter(FluxAttention)
class Flux1Adapter(JointAdapter):
    """`FluxAttention(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)`: the joint
    defaults (`FLUX_LAYOUT`, all three call arguments), no KV cache, image-only calls unprojected."""

    family = "FLUX.1"
    project_alone = False
