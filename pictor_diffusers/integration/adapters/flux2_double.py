"""FLUX.2's double-stream `Flux2Attention`, as diffusers' `Flux2AttnProcessor` / `Flux2KVAttnProcessor` run it.

Image and text tokens with their own Q/K/V projections (separate, or fused by
`fuse_qkv_projections()`) and QK RMSNorms, joined [text, image], rotated by
`image_rotary_emb`, attended; returns `(to_out(image), to_add_out(text))`, or
`to_out(image)` without text. FLUX.2-klein's reference-image KV cache is served:
the text length is that of `encoder_hidden_states`.
"""

from __future__ import annotations

from diffusers.models.transformers.transformer_flux2 import Flux2Attention

from .base import register_adapter
from .joint import JointAdapter


@register_adapter(Flux2Attention)
class Flux2DoubleAdapter(JointAdapter):
    """`Flux2Attention(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, **kv)`: the
    joint defaults (`FLUX_LAYOUT`, all three call arguments, image-only calls projected) and the KV cache."""

    family = "FLUX.2"
    kv_cache = True
