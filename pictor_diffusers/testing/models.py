"""Randomly initialised FLUX.2 and FLUX.1 transformers and inputs for the tests and benchmarks.

Weights come from the model's own initialisation under a fixed seed; nothing is
downloaded. Token ids follow FLUX.2's layout: text ids count along axis 3,
image ids hold (row, column) on axes 1 and 2. FLUX.1's ids have 3 axes, as its
pipelines make them: image (0, row, column), text all zero.
"""

from __future__ import annotations

import torch
from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel
from diffusers.models.transformers import transformer_flux2
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
)

HAS_KV_PROCESSORS = hasattr(transformer_flux2, "Flux2KVAttnProcessor")
"""Whether this diffusers has FLUX.2-klein's reference-image KV processors (added after 0.36)."""

TINY_CONFIG = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 48,
    "timestep_guidance_channels": 32,
    "mlp_ratio": 3.0,
    "axes_dims_rope": (8, 8, 8, 8),
    "rope_theta": 2000,
    "eps": 1e-6,
    "guidance_embeds": True,
}

KLEIN_4B_CONFIG = {
    **TINY_CONFIG,
    "in_channels": 128,
    "num_layers": 5,
    "num_single_layers": 20,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256,
    "axes_dims_rope": (32, 32, 32, 32),
    "guidance_embeds": False,
}
"""FLUX.2-klein-4B's transformer shape: 24 heads of 128, 5 double and 20 single blocks."""


def build_transformer(config: dict | None = None, seed: int = 0, **device_dtype) -> Flux2Transformer2DModel:
    """A FLUX.2 transformer with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**(config or TINY_CONFIG))
    return model.to(**device_dtype).eval()


def image_ids(height: int, width: int) -> torch.Tensor:
    """`[height*width, 4]` ids: (0, row, column, 0)."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.zeros(height * width, 4)
    ids[:, 1] = rows.flatten()
    ids[:, 2] = cols.flatten()
    return ids


def text_ids(length: int) -> torch.Tensor:
    """`[length, 4]` ids: (0, 0, 0, position)."""
    ids = torch.zeros(length, 4)
    ids[:, 3] = torch.arange(length)
    return ids


def transformer_inputs(
    model: Flux2Transformer2DModel | FluxTransformer2DModel,
    batch: int,
    latent_hw: tuple[int, int],
    text_len: int,
    seed: int = 1,
) -> dict:
    """Random N(0,1) keyword inputs for a FLUX.2 (or, with `flux1_transformer_inputs`' additions,
    FLUX.1) `model.forward`, on the model's device and dtype."""
    param = next(model.parameters())
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    height, width = latent_hw
    hidden = torch.randn(batch, height * width, config.in_channels, generator=generator)
    text = torch.randn(batch, text_len, config.joint_attention_dim, generator=generator)
    inputs = {
        "hidden_states": hidden.to(param.device, param.dtype),
        "encoder_hidden_states": text.to(param.device, param.dtype),
        "timestep": torch.full((batch,), 0.5, device=param.device, dtype=param.dtype),
        "img_ids": image_ids(height, width).to(param.device),
        "txt_ids": text_ids(text_len).to(param.device),
        "return_dict": False,
    }
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), 3.5, device=param.device, dtype=param.dtype)
    return inputs


def set_kv_processors(model: Flux2Transformer2DModel) -> None:
    """diffusers' own reference-image KV processors, as `Flux2KleinKVPipeline` installs them
    (`HAS_KV_PROCESSORS` says whether this diffusers has them)."""
    for module in model.modules():
        if isinstance(module, Flux2ParallelSelfAttention):
            module.set_processor(transformer_flux2.Flux2KVParallelSelfAttnProcessor())
        elif isinstance(module, Flux2Attention):
            module.set_processor(transformer_flux2.Flux2KVAttnProcessor())


def set_stock_processors(model: Flux2Transformer2DModel) -> None:
    """Put diffusers' default FLUX.2 processors back on every attention module."""
    processors = {}
    for name in model.attn_processors:
        parent = model.get_submodule(name.removesuffix(".processor"))
        single = type(parent).__name__ == "Flux2ParallelSelfAttention"
        processors[name] = Flux2ParallelSelfAttnProcessor() if single else Flux2AttnProcessor()
    model.set_attn_processor(processors)


FLUX1_DEV_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
"""FLUX.1-dev's transformer shape: 24 heads of 128, 19 double and 38 single blocks (11.9B parameters)."""

FLUX1_TEXT_TOKENS = 512
"""FLUX.1-dev's T5 sequence length."""

TINY_FLUX1_CONFIG = {
    "patch_size": 1,
    "in_channels": 8,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "joint_attention_dim": 24,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (8, 8, 16),
}
"""A FLUX.1 transformer small enough for CPU tests: 2 double and 2 single blocks, 4 heads of 32."""


def build_flux1_transformer(config: dict | None = None, seed: int = 0, **device_dtype) -> FluxTransformer2DModel:
    """A FLUX.1 transformer with seeded random weights, in eval mode (default shape: FLUX.1-dev)."""
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**(config or FLUX1_DEV_CONFIG))
    return model.to(**device_dtype).eval()


def flux1_ids(latent_hw: tuple[int, int], text_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(image ids `[h*w, 3]` = (0, row, column), text ids `[text_len, 3]` = 0)."""
    height, width = latent_hw
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    image = torch.zeros(height * width, 3)
    image[:, 1] = rows.flatten()
    image[:, 2] = cols.flatten()
    return image, torch.zeros(text_len, 3)


def flux1_transformer_inputs(
    model: FluxTransformer2DModel,
    batch: int,
    latent_hw: tuple[int, int],
    text_len: int = FLUX1_TEXT_TOKENS,
    seed: int = 1,
) -> dict:
    """Random N(0,1) keyword inputs for a FLUX.1 `model.forward`, on the model's device and dtype.

    `latent_hw` is the packed latent grid: a 1024² image is (64, 64), 4096 image tokens.
    """
    inputs = transformer_inputs(model, batch, latent_hw, text_len, seed)
    param = next(model.parameters())
    generator = torch.Generator().manual_seed(seed + 1)
    pooled = torch.randn(batch, model.config.pooled_projection_dim, generator=generator)
    image_ids, text_ids = flux1_ids(latent_hw, text_len)
    inputs["pooled_projections"] = pooled.to(param.device, param.dtype)
    inputs["img_ids"], inputs["txt_ids"] = image_ids.to(param.device), text_ids.to(param.device)
    return inputs


def set_flux1_stock_processors(model: FluxTransformer2DModel) -> None:
    """Put diffusers' default FLUX.1 processor (on the dispatcher's active backend) on every attention module."""
    model.set_attn_processor(FluxAttnProcessor())
