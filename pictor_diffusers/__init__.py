"""pictor-diffusers: CUDA attention kernels for FLUX.2 in diffusers.

from pictor_diffusers import PictorAttn
pipe.transformer.set_attn_processor(PictorAttn())                  # f32-accurate parity path
pipe.transformer.set_attn_processor(PictorAttn(precision="bf16"))  # 16-bit fast path
"""

from .ops import attention
from .processor import PictorAttn

__all__ = ["PictorAttn", "__version__", "attention"]
__version__ = "0.2.0"
