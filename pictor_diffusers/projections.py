"""The q/k/v projections of FLUX attention modules, as prologue segments.

FLUX.1's `FluxAttention` and FLUX.2's `Flux2Attention` name their layers alike:
`to_q`/`to_k`/`to_v` (or `to_qkv` after `fuse_qkv_projections()`) for image
tokens, `add_q_proj`/`add_k_proj`/`add_v_proj` (or `to_added_qkv`) for text
tokens, and `norm_q`/`norm_k`, `norm_added_q`/`norm_added_k` for the QK norms.
"""

from __future__ import annotations

import torch

from .prologue import Segment


def joint_segments(attn: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
                   ) -> list[Segment]:  # fmt: skip
    """[text, image] segments (image only without text), projections `[B, n, H*D]` in the model dtype.

    Raises ValueError when text is given to a module without text projections.
    """
    if getattr(attn, "fused_projections", False):
        image = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        image = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
    segments = [Segment(*image, attn.norm_q, attn.norm_k)]
    if encoder_hidden_states is None:
        return segments
    if attn.added_kv_proj_dim is None:
        raise ValueError(
            f"this {type(attn).__name__} has no text projections (added_kv_proj_dim=None) but got encoder_hidden_states"
        )
    if getattr(attn, "fused_projections", False) and hasattr(attn, "to_added_qkv"):
        text = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
    else:
        text = tuple(proj(encoder_hidden_states) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    return [Segment(*text, attn.norm_added_q, attn.norm_added_k), *segments]
