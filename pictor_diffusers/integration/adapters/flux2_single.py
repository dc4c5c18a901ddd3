"""FLUX.2's single-stream `Flux2ParallelSelfAttention`, as diffusers' `Flux2ParallelSelfAttnProcessor` /
`Flux2KVParallelSelfAttnProcessor` run it.

One projection `to_qkv_mlp_proj` yields Q/K/V and the MLP input together; Q and K
go through `norm_q` / `norm_k`, the tokens (text and image, already joined) are
rotated by `image_rotary_emb` and attended, and `to_out` projects the attention
output and the activated MLP branch together. FLUX.2-klein's reference-image KV
cache is served: the text length is the `num_txt_tokens` argument.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttention

from ...ops.prologue import Segment
from .base import Adapter, Attend, Call, register_adapter


@register_adapter(Flux2ParallelSelfAttention)
class Flux2SingleAdapter(Adapter):
    """`Flux2ParallelSelfAttention(hidden_states, attention_mask, image_rotary_emb, **kv)`."""

    family = "FLUX.2"
    args = ("attention_mask", "image_rotary_emb")
    kv_cache = True

    def kv_text_len(self, encoder_hidden_states: torch.Tensor | None, num_txt_tokens: int) -> int:
        """The text tokens at the front of the joined sequence: `num_txt_tokens`."""
        return num_txt_tokens

    def forward(self, attn: Flux2ParallelSelfAttention, call: Call, attend: Attend) -> torch.Tensor:
        """`to_out([attention, mlp_act_fn(mlp)])`: `[B, N, C]` in the model dtype; the projection's output is
        split into Q/K/V and MLP parts in the ratio of their widths, as stock splits it."""
        projected = attn.to_qkv_mlp_proj(call.hidden_states)
        qkv_width = 3 * attn.inner_dim
        mlp_width = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = projected.shape[-1] * qkv_width // (qkv_width + mlp_width)
        qkv, mlp_hidden_states = projected.split([local_qkv, projected.shape[-1] - local_qkv], dim=-1)
        segment = Segment(*qkv.chunk(3, dim=-1), attn.norm_q, attn.norm_k)

        attn_output = attend([segment], attn.head_dim, call.image_rotary_emb, call.kv)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([attn_output, mlp_hidden_states], dim=-1))
