"""pictor-diffusers: CUDA attention kernels for FLUX.2 in diffusers.

from pictor_diffusers import PictorAttn
pipe.transformer.set_attn_processor(PictorAttn())                  # f32-accurate parity path
pipe.transformer.set_attn_processor(PictorAttn(precision="bf16"))  # 16-bit fast path
pipe.transformer.set_attn_processor(PictorAttn(precision="fp8"))   # 8-bit path (Hopper, lossy)
pipe.transformer.set_attention_backend("pictor")                   # any model on diffusers' dispatcher

Importing the package registers the "pictor", "pictor_bf16" and "pictor_fp16"
attention backends with diffusers (`pictor_diffusers.integration.backend`).
"""

from .integration.backend import register_backends

register_backends()  # first: before the imports below load diffusers' models (DIFFUSERS_ATTN_BACKEND=pictor)

from .integration.processor import PictorAttn  # noqa: E402
from .ops.attention import attention  # noqa: E402

__all__ = ["PictorAttn", "__version__", "attention", "register_backends"]
__version__ = "0.2.0"
