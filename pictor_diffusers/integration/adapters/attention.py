"""diffusers' generic `Attention`, for the models whose processors call SDPA themselves: SD3 / SD3.5 and CogVideoX.

Which processor's math runs is read from the module and the call, as those models build and call it:

| module | call | as | adapter |
| --- | --- | --- | --- |
| `add_q_proj` set | any | `JointAttnProcessor2_0`: SD3's joint attention | `sd3.SD3Adapter` |
| no `add_q_proj` | with text | `CogVideoXAttnProcessor2_0`: [text, video] attention | `cogvideox.CogVideoXAdapter` |
| no `add_q_proj` | no text | `JointAttnProcessor2_0` without text (SD3.5's `attn2`) | `sd3.SD3Adapter` |

Other models' `Attention` modules use other processors (cross-attention, masks, group norms, ...):
`attention_parts.check_module` refuses the settings SD3 and CogVideoX never use, naming the attribute.
A self-attention module that another model calls with `encoder_hidden_states` as cross-attention input
(`AttnProcessor2_0`) would be computed the CogVideoX way: set PictorAttn on SD3 and CogVideoX transformers only.
"""

from __future__ import annotations

from typing import ClassVar

from diffusers.models.attention_processor import Attention

from .attention_parts import check_module
from .base import Adapter, Attend, Call, Output, register_adapter
from .cogvideox import CogVideoXAdapter
from .sd3 import SD3Adapter


@register_adapter(Attention)
class AttentionAdapter(Adapter):
    """`Attention(hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)`: checks the module,
    then runs SD3's or CogVideoX's adapter, by the table in the module docstring."""

    family = "SD3 or CogVideoX"
    sd3: ClassVar[SD3Adapter] = SD3Adapter()
    cogvideox: ClassVar[CogVideoXAdapter] = CogVideoXAdapter()

    def forward(self, attn: Attention, call: Call, attend: Attend) -> Output:
        """What the stock processor of `attn`'s model returns (see `sd3` and `cogvideox`)."""
        check_module(attn, call.hidden_states)
        if getattr(attn, "add_q_proj", None) is None and call.encoder_hidden_states is not None:
            return self.cogvideox.forward(attn, call, attend)
        return self.sd3.forward(attn, call, attend)
