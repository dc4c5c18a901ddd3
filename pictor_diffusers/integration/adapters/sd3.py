"""SD3 / SD3.5's attention, as diffusers' `JointAttnProcessor2_0` (and `FusedJointAttnProcessor2_0`) run it.

`SD3Transformer2DModel` builds diffusers' generic `Attention` (`attention.AttentionAdapter` routes here):

* joint attention (`JointTransformerBlock.attn`: text projections `add_q_proj`, ... set): image and text
  projections, per-head QK norms (none for SD3, diffusers' `RMSNorm` for SD3.5; `torch.nn.LayerNorm` is
  served too), one attention over both runs, split again; returns `(to_out(image), to_add_out(text))`, the
  text part unprojected where the block is `context_pre_only` (SD3's last block, `to_add_out=None`);
* self-attention (SD3.5's dual-attention `attn2`, `SD3SingleTransformerBlock.attn`, and a joint module
  called without text): returns `to_out(attention)`.

Stock joins [image, text]; pictor joins [text, image]. Without RoPE or a mask attention does not depend on the
order of the keys, so only the order of the float32 sums differs. After `fuse_qkv_projections()` pictor reads
the fused layers and still applies the QK norms (stock's fused processor skips them). SD3 has no RoPE: an
`image_rotary_emb` is refused, as is any `attention_mask` (SD3 passes neither).
"""

from __future__ import annotations

from diffusers.models.attention_processor import Attention

from .attention_parts import segments
from .base import Adapter, Attend, Call, Output
from .joint import project


class SD3Adapter(Adapter):
    """`Attention(hidden_states, encoder_hidden_states=None)` of SD3 / SD3.5; see the module."""

    family = "SD3"

    def forward(self, attn: Attention, call: Call, attend: Attend) -> Output:
        """`(to_out(image), to_add_out(text) or text)` with text, else `to_out(attention)`; each `[B, n, C]`
        in the model dtype."""
        if call.image_rotary_emb is not None:
            raise TypeError(
                f"PictorAttn runs this {type(attn).__name__} as SD3 does (JointAttnProcessor2_0), without RoPE, "
                "but got image_rotary_emb"
            )
        text = call.encoder_hidden_states
        parts, head_dim = segments(attn, call.hidden_states, text)
        attended = attend(parts, head_dim, None, None)
        if text is None:
            return project(attn.to_out, attended)
        text_out, image_out = attended.split_with_sizes([text.shape[1], attended.shape[1] - text.shape[1]], dim=1)
        if attn.to_add_out is not None:
            text_out = attn.to_add_out(text_out)
        return project(attn.to_out, image_out), text_out
