"""Randomly initialised SD3 / SD3.5 and CogVideoX transformers and inputs: the models whose stock processors call
SDPA themselves (served by `PictorAttn` through `integration/adapters/attention.py`).

Weights come from the model's own initialisation under a fixed seed; nothing is downloaded. CogVideoX's RoPE
tables are made as its pipeline makes them (`get_3d_rotary_pos_embed`, 1.0's crop region or 1.5's "slice"
grid).
"""

from __future__ import annotations

import torch
from diffusers import CogVideoXTransformer3DModel, SD3Transformer2DModel
from diffusers.models.attention_processor import (
    CogVideoXAttnProcessor2_0,
    FusedCogVideoXAttnProcessor2_0,
    FusedJointAttnProcessor2_0,
    JointAttnProcessor2_0,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

STOCK_PROCESSORS = (
    JointAttnProcessor2_0,
    FusedJointAttnProcessor2_0,
    CogVideoXAttnProcessor2_0,
    FusedCogVideoXAttnProcessor2_0,
)
"""diffusers' own processors of SD3 / SD3.5 and CogVideoX (plain and after `fuse_qkv_projections()`)."""

TINY_SD3_CONFIG = {
    "sample_size": 32,
    "patch_size": 1,
    "in_channels": 4,
    "num_layers": 3,
    "attention_head_dim": 16,
    "num_attention_heads": 3,
    "caption_projection_dim": 48,
    "joint_attention_dim": 24,
    "pooled_projection_dim": 20,
    "out_channels": 4,
    "pos_embed_max_size": 32,
    "dual_attention_layers": (),
    "qk_norm": None,
}
"""SD3 (medium)'s layout, small enough for CPU tests: 3 joint blocks (the last `context_pre_only`), no QK norm."""

TINY_SD35_CONFIG = {**TINY_SD3_CONFIG, "dual_attention_layers": (0, 1), "qk_norm": "rms_norm"}
"""SD3.5's layout: RMSNorm QK norms and dual-attention (`attn2`) blocks."""

TINY_COGVIDEOX_CONFIG = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 8,
    "text_embed_dim": 12,
    "num_layers": 2,
    "sample_width": 20,
    "sample_height": 14,
    "sample_frames": 9,
    "patch_size": 2,
    "patch_size_t": None,
    "max_text_seq_length": 7,
}
"""CogVideoX 1.0 (2B)'s layout, small: LayerNorm QK norms, learned-free sin-cos positions, no RoPE."""

TINY_COGVIDEOX_ROPE_CONFIG = {**TINY_COGVIDEOX_CONFIG, "use_rotary_positional_embeddings": True}
"""CogVideoX 1.0 (5B)'s layout: RoPE on the video tokens."""

TINY_COGVIDEOX15_CONFIG = {**TINY_COGVIDEOX_ROPE_CONFIG, "patch_size_t": 2}
"""CogVideoX 1.5's layout: temporal patches of 2 frames, RoPE on the "slice" grid."""


def build_sd3(config: dict, seed: int = 0, **device_dtype) -> SD3Transformer2DModel:
    """An SD3 transformer with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    return SD3Transformer2DModel(**config).to(**device_dtype).eval()


def sd3_inputs(model: SD3Transformer2DModel, batch: int, latent_hw: tuple[int, int], text_len: int) -> dict:
    """Seeded N(0, 1) keyword inputs for `model.forward` in its dtype: latents `[B, C, h, w]`
    (h * w / patch_size² image tokens), `text_len` text tokens."""
    config, param = model.config, next(model.parameters())
    generator = torch.Generator().manual_seed(1)
    shapes = {
        "hidden_states": (batch, config.in_channels, *latent_hw),
        "encoder_hidden_states": (batch, text_len, config.joint_attention_dim),
        "pooled_projections": (batch, config.pooled_projection_dim),
    }
    inputs = {name: torch.randn(shape, generator=generator).to(param) for name, shape in shapes.items()}
    return {**inputs, "timestep": torch.tensor([500, 20] * batch)[:batch], "return_dict": False}


def build_cogvideox(config: dict, seed: int = 0, **device_dtype) -> CogVideoXTransformer3DModel:
    """A CogVideoX transformer with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(**config).to(**device_dtype).eval()


def cogvideox_rope(config: dict, frames: int, latent_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each `[video tokens, head_dim]`, as `CogVideoXPipeline._prepare_rotary_positional_embeddings`
    makes them for `frames` latent frames of `latent_hw`."""
    patch, patch_t = config["patch_size"], config["patch_size_t"]
    grid = (latent_hw[0] // patch, latent_hw[1] // patch)
    base = (config["sample_height"] // patch, config["sample_width"] // patch)
    head_dim = config["attention_head_dim"]
    if patch_t is None:
        crops = get_resize_crop_region_for_grid(grid, base[1], base[0])
        return get_3d_rotary_pos_embed(head_dim, crops, grid, frames)
    temporal = (frames + patch_t - 1) // patch_t
    return get_3d_rotary_pos_embed(head_dim, None, grid, temporal, grid_type="slice", max_size=base)


def cogvideox_inputs(
    model: CogVideoXTransformer3DModel, batch: int, frames: int, latent_hw: tuple[int, int], text_len: int
) -> dict:
    """Seeded N(0, 1) keyword inputs for `model.forward` in its dtype: latents `[B, frames, C, h, w]`, text,
    and the RoPE tables where the model uses RoPE."""
    config, param = model.config, next(model.parameters())
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, frames, config.in_channels, *latent_hw, generator=generator).to(param)
    text = torch.randn(batch, text_len, config.text_embed_dim, generator=generator).to(param)
    inputs = {"hidden_states": latents, "encoder_hidden_states": text, "return_dict": False}
    inputs["timestep"] = torch.tensor([500, 20] * batch)[:batch]
    if config.use_rotary_positional_embeddings:
        rope = cogvideox_rope(dict(config), frames, latent_hw)
        inputs["image_rotary_emb"] = tuple(t.to(param.device) for t in rope)
    return inputs
