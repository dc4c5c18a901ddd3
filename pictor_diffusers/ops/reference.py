"""Pure-torch online-softmax attention: the CPU path and the kernel's twin; `twin_attention` runs a kernel's twin.

Same algorithm as `kernels/flash_attn_f32.cu`: keys stream in tiles, each query
row keeps a running max `m`, a running sum `l` and an f32 accumulator, and the
output is `acc / l`. Everything runs in float32 (inputs are upcast). The tile
is wider than the kernel's 32 keys so that CPU matmuls stay efficient; the
result differs from the kernel only by f32 reassociation.
"""

from __future__ import annotations

import torch

from ..cuda.registry import BY_NAME
from .quant_reference import kernel_twin

CPU_TILE_KEYS = 256


def online_softmax_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    tile_keys: int = CPU_TILE_KEYS,
    return_lse: bool = False,
    key_lens: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention by online softmax, in float32.

    Args:
        query: head-major `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]`; any float dtype.
        scale: multiplies the logits `Q K^T`.
        tile_keys: keys per online-softmax step.
        return_lse: also return each row's natural log-sum-exp of its scaled logits.
        key_lens: `[B]` integers or None: batch b attends its first `key_lens[b]` keys (clamped to
            [0, Nk]), as the kernels do; a batch with none gets rows of 0 and LSE -inf (as torch's SDPA).
        key_bias: `[B, 1 or H, Nk]` float or None: added to the scaled logits in float32; a row whose keys are
            all -inf gets 0 and LSE -inf, as the kernels give.

    Returns:
        token-major `[B, Nq, H*D]` float32, and with `return_lse` the LSE `[B, Nq, H]` float32.
    """
    batch, heads, seq, head_dim = query.shape
    q, k, v = (t.float().contiguous() for t in (query, key, value))  # strides must not pick other BLAS kernels
    running_max = torch.full((batch, heads, seq, 1), float("-inf"), dtype=torch.float32, device=q.device)
    running_sum = torch.zeros((batch, heads, seq, 1), dtype=torch.float32, device=q.device)
    acc = torch.zeros((batch, heads, seq, head_dim), dtype=torch.float32, device=q.device)
    kept = None if key_lens is None else key_lens.to(q.device, torch.int64).clamp(0, k.shape[2]).view(batch, 1, 1, 1)
    bias = None if key_bias is None else key_bias.float().unsqueeze(2)
    for start in range(0, k.shape[2], tile_keys):
        k_tile = k[:, :, start : start + tile_keys]
        v_tile = v[:, :, start : start + tile_keys]
        scores = torch.matmul(q, k_tile.transpose(-1, -2)) * scale
        if bias is not None:
            scores = scores + bias[..., start : start + tile_keys]
        if kept is not None:
            index = torch.arange(start, start + k_tile.shape[2], device=q.device)
            scores = scores.masked_fill(index >= kept, float("-inf"))
            if not start:  # a batch with no keys: its running max stays -inf, and -inf - -inf is NaN
                scores = scores.masked_fill(kept == 0, 0.0)
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        shift = new_max if bias is None else new_max.masked_fill(new_max == float("-inf"), 0.0)  # no -inf - -inf
        correction = torch.exp(running_max - shift)
        probs = torch.exp(scores - shift)
        running_sum = running_sum * correction + probs.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(probs, v_tile)
        running_max = new_max
    if kept is not None:
        acc = acc.masked_fill(kept == 0, 0.0)
        running_max = running_max.masked_fill(kept == 0, float("-inf"))
    if bias is not None:
        running_sum = running_sum.masked_fill(running_sum == 0, 1.0)  # rows of only -inf keys: acc 0, LSE -inf
    out = (acc / running_sum).transpose(1, 2).contiguous().view(batch, seq, heads * head_dim)
    if not return_lse:
        return out
    lse = (running_max + torch.log(running_sum)).squeeze(-1).transpose(1, 2).contiguous()
    return out, lse


def twin_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, kernel: str, out_dtype: torch.dtype,
    return_lse: bool = False, key_lens: torch.Tensor | None = None, key_bias: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`kernel`'s CPU twin on checked inputs, the output in `out_dtype`: the 8-bit kernel's quantised twin
    (`quant_reference.kernel_twin`, refusing a head_dim outside its registry row's, as the kernel does), else
    `online_softmax_attention` in float32. With `return_lse`, also the float32 LSE `[B, Nq, H]`."""
    spec = BY_NAME.get(kernel)
    if spec is not None and spec.family == "8bit":
        if key_bias is not None:
            raise ValueError(f"kernel={kernel!r} takes no key_bias; the 16-bit kernels ('auto') do")
        if query.shape[-1] not in spec.head_dims:
            raise ValueError(f"kernel={kernel!r} takes head_dim {spec.head_dims}, got head_dim={query.shape[-1]}")
        result = kernel_twin(query, key, value, scale, return_lse=return_lse, key_lens=key_lens, kernel=kernel)
    else:
        upcast = tuple(t.float() for t in (query, key, value))
        result = online_softmax_attention(*upcast, scale, return_lse=return_lse, key_lens=key_lens, key_bias=key_bias)
    if return_lse:
        out, lse = result
        return out.to(out_dtype), lse
    return result.to(out_dtype)
