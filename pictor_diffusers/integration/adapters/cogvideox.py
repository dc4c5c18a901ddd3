"""CogVideoX's attention, as diffusers' `CogVideoXAttnProcessor2_0` (and `FusedCogVideoXAttnProcessor2_0`) run it.

`CogVideoXBlock.attn1` is diffusers' generic `Attention` without text projections, called with the text as
`encoder_hidden_states` (`attention.AttentionAdapter` routes here): text and video tokens are joined
[text, video] before one set of Q/K/V projections (separate, or fused by `fuse_qkv_projections()`), the
per-head QK `LayerNorm` (or none) normalises every token, RoPE rotates only the video tokens' q and k, and
`to_out` projects all tokens; returns `(video, text)`, each `[B, n, C]`.

RoPE: `image_rotary_emb` is `(cos, sin)`, each `[N_video, D]` with interleaved pairs (CogVideoX's
`get_3d_rotary_pos_embed`), applied as diffusers' `apply_rotary_emb`, the same rotation as FLUX's. pictor
gives the text rows cos 1 and sin 0, which leave them exactly as they are, so the prologue rotates all tokens
at once. Masks are refused (CogVideoX passes none).
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention

from ...ops.prologue import Rope
from .attention_parts import segments
from .base import Adapter, Attend, Call
from .joint import project


def text_unrotated(rope: Rope | None, text_len: int, video_len: int) -> Rope | None:
    """`(cos, sin)` `[text_len + video_len, D]`: identity rows (cos 1, sin 0) for the text, then `rope`'s."""
    if rope is None:
        return None
    cos, sin = rope
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] != video_len:
        raise ValueError(
            f"CogVideoX's image_rotary_emb must be (cos, sin), each [{video_len}, head_dim] for the {video_len} "
            f"video tokens; got shapes {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    identity = (cos.new_ones(text_len, cos.shape[1]), sin.new_zeros(text_len, sin.shape[1]))
    return torch.cat([identity[0], cos]), torch.cat([identity[1], sin])


class CogVideoXAdapter(Adapter):
    """`Attention(hidden_states, encoder_hidden_states, image_rotary_emb=None)` of CogVideoX; see the module."""

    family = "CogVideoX"

    def forward(self, attn: Attention, call: Call, attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """`(video, text)` outputs of `to_out`, `[B, n_video, C]` and `[B, n_text, C]` in the model dtype."""
        text, video = call.encoder_hidden_states, call.hidden_states
        parts, head_dim = segments(attn, torch.cat([text, video], dim=1), None)
        rope = text_unrotated(call.image_rotary_emb, text.shape[1], video.shape[1])
        attended = project(attn.to_out, attend(parts, head_dim, rope, None))
        text_out, video_out = attended.split_with_sizes([text.shape[1], video.shape[1]], dim=1)
        return video_out, text_out
