"""The embedded default: a small FLUX.2 [klein] pipeline built in code, random weights.

Transformer, VAE and scheduler come from configs with randomly initialised
weights; there is no tokenizer or text encoder. Prompt embeddings are drawn
deterministically from the prompt text, so the same prompt always gives the
same embeddings. The pictures are noise; the point is that the real denoising
loop (scheduler, transformer through PictorAttn, VAE decode) runs anywhere,
from a fresh install, in seconds on a laptop CPU.
"""

from __future__ import annotations

import hashlib

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

TEXT_TOKENS = 32
TEXT_DIM = 96


def tiny_pipeline(dtype: torch.dtype, seed: int = 0) -> Flux2KleinPipeline:
    """A FLUX.2 [klein] pipeline of ~3M random parameters (no text encoder)."""
    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 32, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1,
        latent_channels=8,
        norm_num_groups=8,
        sample_size=256,
    )
    transformer = Flux2Transformer2DModel(
        in_channels=32,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=128,  # FLUX.2's head_dim, so a GPU runs the production kernels
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=64,
        axes_dims_rope=(32, 32, 32, 32),
        guidance_embeds=False,
    )
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        transformer=transformer,
        is_distilled=True,
    )
    return pipe.to(dtype=dtype)


def synthetic_prompt_embeds(prompt: str, batch: int = 1) -> torch.Tensor:
    """`[batch, TEXT_TOKENS, TEXT_DIM]` float32 embeddings drawn from a seed hashed from `prompt`."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, TEXT_TOKENS, TEXT_DIM, generator=generator)
