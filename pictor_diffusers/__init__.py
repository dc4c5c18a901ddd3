"""pictor-diffusers: f32-exact CUDA attention kernels for FLUX.2 in diffusers.

from pictor_diffusers import PictorAttn
pipe.transformer.set_attn_processor(PictorAttn())
"""

from .ops import attention
from .processor import PictorAttn

__all__ = ["PictorAttn", "__version__", "attention"]
__version__ = "0.1.0"
