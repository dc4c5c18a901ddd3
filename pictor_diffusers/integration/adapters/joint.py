"""Joint [text, image] attention, as FLUX.1's `FluxAttention` and FLUX.2's `Flux2Attention` compute it.

Image tokens have Q/K/V projections (separate, or fused by `fuse_qkv_projections()`), text tokens
their own (`added_kv_proj_dim` set); each has its QK RMSNorm. The two runs are joined [text, image],
rotated by one RoPE table, attended together, split again and sent through their output projections.
`JointLayout` names where a module keeps these parts; FLUX.1 and FLUX.2 use `FLUX_LAYOUT`.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

from ...ops.prologue import Segment
from .base import Adapter, Attend, Call, Output


class JointLayout(NamedTuple):
    """Attribute names of a joint-attention module's parts (image, then text)."""

    qkv: tuple[str, str, str] = ("to_q", "to_k", "to_v")
    fused_qkv: str = "to_qkv"
    norms: tuple[str, str] = ("norm_q", "norm_k")
    out: str = "to_out"
    added_qkv: tuple[str, str, str] = ("add_q_proj", "add_k_proj", "add_v_proj")
    fused_added_qkv: str = "to_added_qkv"
    added_norms: tuple[str, str] = ("norm_added_q", "norm_added_k")
    added_out: str = "to_add_out"


FLUX_LAYOUT = JointLayout()


def _segment(attn: torch.nn.Module, tokens: torch.Tensor, qkv: tuple[str, ...], fused: str,
             norms: tuple[str, str]) -> Segment:  # fmt: skip
    """One run's projections `[B, n, H*D]` (model dtype), from the fused layer once fused, and its norms."""
    if getattr(attn, "fused_projections", False) and hasattr(attn, fused):
        projected = getattr(attn, fused)(tokens).chunk(3, dim=-1)
    else:
        projected = tuple(getattr(attn, name)(tokens) for name in qkv)
    return Segment(*projected, *(getattr(attn, name) for name in norms))


def joint_segments(attn: torch.nn.Module, layout: JointLayout, hidden_states: torch.Tensor,
                   encoder_hidden_states: torch.Tensor | None) -> list[Segment]:  # fmt: skip
    """[text, image] segments (image only without text); ValueError for text to a module without text
    projections."""
    image = _segment(attn, hidden_states, layout.qkv, layout.fused_qkv, layout.norms)
    if encoder_hidden_states is None:
        return [image]
    if getattr(attn, layout.added_qkv[0], None) is None:
        raise ValueError(
            f"this {type(attn).__name__} has no text projections (added_kv_proj_dim=None) but got encoder_hidden_states"
        )
    text = _segment(attn, encoder_hidden_states, layout.added_qkv, layout.fused_added_qkv, layout.added_norms)
    return [text, image]


def project(layers: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` through an output projection: one module, or a `ModuleList` applied in order."""
    if not isinstance(layers, torch.nn.ModuleList):
        return layers(tokens)
    for layer in layers:
        tokens = layer(tokens)
    return tokens


class JointAdapter(Adapter):
    """A joint-attention module: `(image, text)` outputs with text, else the image output.

    Attributes:
        layout: where the module keeps its projections, norms and output projections.
        project_alone: whether an image-only call goes through the output projection (FLUX.2) or
            returns the attention output `[B, N, H*D]` unprojected (FLUX.1's `pre_only` blocks).
    """

    layout: ClassVar[JointLayout] = FLUX_LAYOUT
    project_alone: ClassVar[bool] = True

    def forward(self, attn: torch.nn.Module, call: Call, attend: Attend) -> Output:
        """`(to_out(image), to_add_out(text))`, each `[B, n, C]` in the model dtype; see the class."""
        text = call.encoder_hidden_states
        segments = joint_segments(attn, self.layout, call.hidden_states, text)
        attended = attend(segments, attn.head_dim, call.image_rotary_emb, call.kv)
        if text is None:
            return project(getattr(attn, self.layout.out), attended) if self.project_alone else attended
        text_len = text.shape[1]
        text_out, image_out = attended.split_with_sizes([text_len, attended.shape[1] - text_len], dim=1)
        return project(getattr(attn, self.layout.out), image_out), project(
            getattr(attn, self.layout.added_out), text_out
        )
