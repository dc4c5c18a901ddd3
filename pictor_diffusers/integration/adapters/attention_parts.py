"""diffusers' generic `Attention` module: the configurations pictor serves and the parts it reads.

SD3 / SD3.5 (`JointTransformerBlock`, `SD3SingleTransformerBlock`) and CogVideoX (`CogVideoXBlock`) build
`diffusers.models.attention_processor.Attention` with separate (or, after `fuse_projections()`, fused) Q/K/V
projections, per-head QK norms (none; diffusers' `RMSNorm`; `torch.nn.LayerNorm`), optional text projections
(`add_q_proj`, ...; SD3's joint attention) and `to_out`. `check_module` refuses the settings those models never
use (cross-attention, group / spatial / cross norms, residual connections, grouped K/V heads, added K/V without
`add_q_proj`), naming the attribute; `segments` reads the projections and converts the norms into the
prologue's `QkNorm`s, refusing other norms (across heads, L2) by attribute name.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.normalization import RMSNorm

from ...ops.prologue import QkNorm, RmsParams, Segment
from .joint import FLUX_LAYOUT, joint_segments

UNSERVED = (  # (attribute, the value SD3 and CogVideoX have, the constructor argument that sets it)
    ("is_cross_attention", False, "cross_attention_dim"),
    ("only_cross_attention", False, "only_cross_attention"),
    ("group_norm", None, "norm_num_groups"),
    ("spatial_norm", None, "spatial_norm_dim"),
    ("norm_cross", None, "cross_attention_norm"),
    ("residual_connection", False, "residual_connection"),
    ("rescale_output_factor", 1.0, "rescale_output_factor"),
    ("pre_only", False, "pre_only"),
)


def unserved(attn: Attention, what: str) -> TypeError:
    """The error for a module setting pictor does not serve, naming the module type and `what`."""
    return TypeError(
        f"PictorAttn serves {type(attn).__name__} as SD3, SD3.5 and CogVideoX configure it; "
        f"this one has {what}, which it does not serve"
    )


def check_module(attn: Attention, hidden_states: torch.Tensor) -> None:
    """TypeError naming the first setting of `attn` that SD3 and CogVideoX never use; ValueError for
    `hidden_states` other than `[B, N, C]`. Subclasses (HiDream's, Cosmos's) have processors of their own:
    refused too."""
    if type(attn) is not Attention:
        raise TypeError(
            f"PictorAttn serves diffusers' Attention as SD3, SD3.5 and CogVideoX use it, not its subclass "
            f"{type(attn).__name__}"
        )
    for name, served, argument in UNSERVED:
        value = getattr(attn, name)
        if value != served:
            shown = type(value).__name__ if isinstance(value, torch.nn.Module) else repr(value)
            raise unserved(attn, f"{name}={shown} (set by {argument})")
    if attn.inner_kv_dim != attn.inner_dim:
        raise unserved(attn, f"grouped K/V heads (inner_kv_dim={attn.inner_kv_dim}, inner_dim={attn.inner_dim})")
    if attn.added_kv_proj_dim is not None and getattr(attn, "add_q_proj", None) is None:
        raise unserved(attn, "added K/V projections without add_q_proj (context_pre_only=None)")
    if hidden_states.ndim != 3:
        raise ValueError(
            f"PictorAttn takes token-major hidden_states [B, N, C] for {type(attn).__name__}, "
            f"got shape {tuple(hidden_states.shape)}"
        )


def qk_norm(attn: Attention, name: str, head_dim: int) -> QkNorm:
    """`attn.<name>` as a prologue norm over head_dim: None, `torch.nn.RMSNorm`, `torch.nn.LayerNorm`, or
    diffusers' `RMSNorm` without bias as `RmsParams`; TypeError names the attribute otherwise."""
    norm = getattr(attn, name, None)
    if norm is None:
        return None
    if isinstance(norm, RMSNorm) and norm.bias is None and tuple(norm.dim) == (head_dim,):
        return RmsParams(norm.weight, norm.eps)
    if isinstance(norm, (torch.nn.RMSNorm, torch.nn.LayerNorm)) and tuple(norm.normalized_shape) == (head_dim,):
        return norm
    shape = getattr(norm, "normalized_shape", getattr(norm, "dim", None))
    over = f" over {tuple(shape)}" if isinstance(shape, tuple) else ""
    bias = " with a bias" if isinstance(norm, RMSNorm) and norm.bias is not None else ""
    raise TypeError(
        f"PictorAttn serves QK norms over each head's {head_dim} channels (RMSNorm, LayerNorm or none); "
        f"{type(attn).__name__}.{name} is a {type(norm).__name__}{over}{bias}"
    )


def head_dim_of(attn: Attention, projection: torch.Tensor) -> int:
    """Channels per head: the projection's width over `attn.heads`, as the stock processors compute it."""
    width = projection.shape[-1]
    if width % attn.heads:
        raise ValueError(f"{type(attn).__name__}'s projections are {width} wide, not a multiple of heads={attn.heads}")
    return width // attn.heads


def segments(attn: Attention, hidden_states: torch.Tensor, text: torch.Tensor | None) -> tuple[list[Segment], int]:
    """([text, image] segments, or [image] without text; head_dim): the projections `[B, n, H*D]` in the
    model dtype (fused ones once fused) with their norms as `QkNorm`s."""
    parts = joint_segments(attn, FLUX_LAYOUT, hidden_states, text)
    head_dim = head_dim_of(attn, parts[-1].query)
    names = [FLUX_LAYOUT.added_norms, FLUX_LAYOUT.norms][-len(parts) :]
    converted = [
        part._replace(norm_q=qk_norm(attn, q, head_dim), norm_k=qk_norm(attn, k, head_dim))
        for part, (q, k) in zip(parts, names, strict=True)
    ]
    return converted, head_dim
