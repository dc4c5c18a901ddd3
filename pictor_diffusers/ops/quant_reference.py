"""8-bit attention (SageAttention2-style) in torch: the numerical twin of the Hopper kernel
`kernels/flash_attn_fp8.cu` (`kernel="fp8"`, and `kernel="int8"` in `INT8_PV_SCHEME`), which `kernel_twin` runs
for CPU tensors.

What the kernel does, tile by tile, emulated in float32:

* K smoothing: K minus its mean over tokens per (b, h, channel); each row's logits shift by one constant,
  so softmax is unchanged, but the int8 range goes to what varies between keys.
* Q -> int8, one scale per (b, h, 64 query rows); K -> int8, one per (b, h, 128 keys); scale absmax / 127,
  codes x * (127 / absmax) in f32, each quotient one IEEE division as in the prepass (x / scale, or torch's
  twice-rounded `127 / tensor`, flips ties), rounded to nearest even, clamp to [-127, 127], absmax floored at
  QUANT_FLOOR. Q's scale also carries `scale * log2(e)` (exp2 domain).
* Logits: the int32 product of the codes (exact in f32 too: |sum| <= 128 * 127^2 < 2^24) times
  q_scale * k_scale; online softmax over 128-key tiles in f32.
* A row's reference max m moves only when a tile's max exceeds it by more than KERNEL_RESCALE_SLACK
  (log2 units); P = 2^(s - m) in [0, 4] -> FP8 E4M3 as P * 448 / 4 (<= 448; E4M3's relative step does not
  depend on the scale, which only decides where tiny P underflow); V -> E4M3, one scale per (b, h, channel).
* P·V per tile in f32 from the FP8 values, added into the f32 accumulator; out = acc / l * v_scale * 4 / 448,
  l the row sum of the rounded P (the kernel's per-tile row-sum wgmma against a block of ones). The kernel
  sums each tile's P·V from 0 in its FP8 wgmma (~14 significant bits over 4 k-steps, not modelled here) and
  adds it to O in f32, as here. Options, for the study `benchmarks/quant_study.py` (its inputs and
  metrics: `pictor_diffusers.testing.quant_study`): V smoothing, a per-row P
  scale, a 14-bit wgmma accumulator (`pv_accum_bits`, truncated per k32 step: milder than measured; with
  `pv_promote=False` over all tiles, as the kernel did before it promoted per tile), FP8 Q/K, bf16 P·V, int8
  P·V (`INT8_PV_SCHEME`: the "int8" kernel's scheme), finer Q/K scale blocks, the exact row sum and no slack.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

LOG2E = math.log2(math.e)
Q_BLOCK = 64
K_TILE = 128
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
U8_MAX = 255.0  # the largest P code of the int8 P·V scheme (u8 x s8 wgmma)
KERNEL_RESCALE_SLACK = 2.0  # F8_SLACK in pv_e4m3.cuh (the "fp8" kernel)
QUANT_FLOOR = 2.0**-43  # QZ_FLOOR in quantize_qkv8.cu: an all-zero block gets a tiny normal scale (codes 0)


def smooth_k(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K minus its mean over tokens: `[B, H, N, D]` any float dtype -> (float32 `[B, H, N, D]`, mean `[B, H, 1, D]`)."""
    mean = key.float().mean(dim=2, keepdim=True)
    return key.float() - mean, mean


def _block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Absmax of `x` `[B, H, N, D]` per block of `block` rows (the last may be short): `[B, H, ceil(N/block)]`."""
    batch, heads, seq, head_dim = x.shape
    padded = F.pad(x.abs(), (0, 0, 0, -seq % block))  # zeros never raise an absmax
    return padded.view(batch, heads, -1, block * head_dim).amax(dim=-1)


def _ratio(numerator: float, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator rounded once in f32, as the prepass's `127.f / amax`: torch's `float / tensor`
    takes the reciprocal, then the product, and differs from it in the last bit for about a quarter of values
    (flipping codes at rounding ties)."""
    return torch.full_like(denominator, numerator) / denominator


def _over(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """numerator / denominator rounded once in f32, as the prepass's `amax / 127.f`: on CUDA, torch's
    `tensor / float` multiplies by the rounded reciprocal (a last-bit difference in the scales)."""
    return numerator / torch.full_like(numerator, denominator)


def _per_row(scales: torch.Tensor, block: int, seq: int) -> torch.Tensor:
    """Block scales `[B, H, nb]` spread to rows: `[B, H, seq, 1]`."""
    return scales.repeat_interleave(block, dim=2)[:, :, :seq, None]


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to FP8 E4M3 (nearest even), saturating at ±448: float8_e4m3fn of the same shape."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize_int8_blocks(x: torch.Tensor, block: int, extra_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per (b, h, block of `block` tokens).

    Args:
        x: `[B, H, N, D]` any float dtype.
        block: tokens per scale (64 for Q, 128 for K); N need not be a multiple.
        extra_scale: folded into the returned scales (Q: softmax scale * log2(e)).

    Returns:
        codes int8 `[B, H, N, D]` in [-127, 127] and float32 scales `[B, H, ceil(N/block)]`, with
        codes * scale ~= x * extra_scale (error <= scale / 2 per element).
    """
    x = x.float()
    absmax = _block_absmax(x, block).clamp_min(QUANT_FLOOR)
    codes = torch.round(x * _per_row(_ratio(INT8_MAX, absmax), block, x.shape[2])).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), _over(absmax, INT8_MAX) * extra_scale


def quantize_fp8_blocks(x: torch.Tensor, block: int, extra_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """As `quantize_int8_blocks` but to FP8 E4M3 (scale absmax / 448): float8_e4m3fn codes, float32 scales."""
    x = x.float()
    absmax = _block_absmax(x, block).clamp_min(QUANT_FLOOR)
    return to_e4m3(x * _per_row(_ratio(FP8_MAX, absmax), block, x.shape[2])), _over(absmax, FP8_MAX) * extra_scale


def quantize_fp8_channels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one scale per (b, h, channel) = absmax over tokens / 448.

    Args:
        x: `[B, H, N, D]` any float dtype.

    Returns:
        codes float8_e4m3fn `[B, H, N, D]` and float32 scales `[B, H, 1, D]`, codes * scale ~= x (relative
        error <= 2^-4 for |x| >= 2^-6 * scale, absolute <= 2^-10 * scale below).
    """
    x = x.float()
    absmax = x.abs().amax(dim=2, keepdim=True).clamp_min(QUANT_FLOOR)
    return to_e4m3(x * _ratio(FP8_MAX, absmax)), _over(absmax, FP8_MAX)


def quantize_int8_channels_centred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int8 about each (b, h, channel)'s mid-range over tokens: codes round((x - centre) / step) in [-127, 127].

    Args:
        x: `[B, H, N, D]` any float dtype.

    Returns:
        codes int8 `[B, H, N, D]`, float32 steps and centres `[B, H, 1, D]`: step (max / 2 - min / 2) / 127
        (the half-range floored at QUANT_FLOOR), centre max / 2 + min / 2 (halves first: neither overflows
        f32 on any finite input), codes * step + centre ~= x within step / 2.
    """
    x = x.float()
    top, bottom = x.amax(dim=2, keepdim=True) / 2, x.amin(dim=2, keepdim=True) / 2
    centre = top + bottom
    step = _over((top - bottom).clamp_min(QUANT_FLOOR), INT8_MAX)
    codes = torch.round((x - centre) / step).clamp(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), step, centre


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` float32 truncated (toward zero) to `bits` significant bits, same shape and dtype."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def _tile_pv(p: torch.Tensor, v: torch.Tensor, accum_bits: int | None, total: torch.Tensor) -> torch.Tensor:
    """`total` plus one tile's P·V (`[..., Nq, Nt] x [..., Nt, D]`) in f32; with `accum_bits` the running sum is
    truncated to that many significant bits after each k=32 chunk (one FP8 wgmma each)."""
    if accum_bits is None:
        return total + p @ v
    for start in range(0, p.shape[-1], 32):
        total = truncate_mantissa(total + p[..., start : start + 32] @ v[..., start : start + 32, :], accum_bits)
    return total


def _round_p(p: torch.Tensor, pv_format: str) -> torch.Tensor:
    """P, already scaled to its code range, rounded as `pv_format` stores it, back in float32."""
    if pv_format == "int8":
        return torch.round(p)  # u8 codes: p <= 255, ties to even as the kernel's cvt.rni (F2IP)
    return to_e4m3(p).float() if pv_format == "fp8" else p.bfloat16().float()


def int8_fp8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float | None = None,
    *,
    qk_format: Literal["int8", "fp8"] = "int8",
    k_smoothing: bool = True,
    v_smoothing: bool = False,
    p_scale: Literal["fixed", "row"] = "fixed",
    pv_accum_bits: int | None = None,
    pv_promote: bool = True,
    pv_format: Literal["fp8", "bf16", "int8"] = "fp8",
    q_block: int = Q_BLOCK,
    k_block: int = K_TILE,
    rescale_slack: float = 0.0,
    row_sum: Literal["exact", "rounded"] = "exact",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention with 8-bit Q·K^T and FP8 P·V, emulating the kernel's arithmetic (see the module doc).

    Args:
        query: head-major `[B, H, Nq, D]`; key, value: `[B, H, Nk, D]`; float32 or bfloat16 (upcast).
        scale: multiplies the logits `Q K^T`; default D**-0.5.
        qk_format: "int8" (absmax/127) or "fp8" E4M3 (absmax/448) codes for Q and K, same blocks.
        k_smoothing: subtract K's per-channel mean before quantising K.
        v_smoothing: quantise V minus its per-channel mean and add the mean back after normalising.
        p_scale: "fixed" quantises P = exp2(s - running max) as P * 448; "row" takes P relative to the row's
            max in this tile (exp2(s - tile max), so each tile's largest P is exactly 448, or 255 as int8) and folds
            exp2(tile max - running max) into that tile's P·V and row sum: one exp2 per row and tile.
        pv_accum_bits: None for f32 P·V per tile; else the FP8 wgmma accumulator's significant bits (e.g. 14),
            truncated once per k32 step (milder than the H200, which behaves as if truncated after every key);
            not with pv_format "int8", whose integer products are exact.
        pv_promote: True: each tile's P·V sums in registers of its own, then is added to the f32 accumulator
            (two-level; "row" needs it); False: the wgmma accumulates into the accumulator itself.
        pv_format: "fp8" as above; "bf16" rounds P and V to bfloat16 instead (no V scales; the
            SageAttention1-style alternative); "int8" codes P as u8, round(255 * exp2(s - tile max)) (needs
            p_scale "row"), and V as int8 about each channel's mid-range (`quantize_int8_channels_centred`;
            not with v_smoothing): P·V exact in integers per tile, as a u8 x s8 wgmma would run it.
        q_block, k_block: rows per Q scale and keys per K scale (1 = per token); defaults 64 and 128.
        rescale_slack: a row's reference max moves only when a tile's max exceeds it by more than this (log2
            units). With p_scale "fixed", P is quantised as exp2(s - reference) * 448 / 2^slack (<= 448); with
            pv_format "int8" (p_scale "row") it bounds a tile's weight exp2(tile max - reference) by 2^slack.
        row_sum: "exact" sums P in f32 before rounding; "rounded" sums the rounded P that P·V uses (what the
            kernel's row-sum wgmma computes).
        return_lse: also return each row's natural log-sum-exp of its (quantised) scaled logits, with the
            shift K smoothing takes off them (scale * q . mean) added back.

    Returns:
        token-major `[B, Nq, H*D]` float32; with `return_lse`, also the LSE `[B, Nq, H]` float32.
    """
    if not pv_promote and p_scale != "fixed":
        raise ValueError(f"p_scale={p_scale!r} rescales each tile's P·V, so it needs pv_promote=True")
    if rescale_slack and p_scale != "fixed" and pv_format != "int8":
        raise ValueError(f"rescale_slack={rescale_slack} needs p_scale='fixed', not {p_scale!r}")
    if pv_format == "int8" and (p_scale != "row" or v_smoothing or pv_accum_bits is not None):
        raise ValueError(
            f"pv_format='int8' needs p_scale='row', no v_smoothing and no pv_accum_bits, got p_scale={p_scale!r}, "
            f"v_smoothing={v_smoothing}, pv_accum_bits={pv_accum_bits}"
        )
    batch, heads, seq, head_dim = query.shape
    scale = head_dim**-0.5 if scale is None else scale
    k, k_mean = smooth_k(key) if k_smoothing else (key.float(), torch.zeros_like(key[:, :, :1]).float())
    v = value.float()
    v_mean = v.mean(dim=2, keepdim=True) if v_smoothing else torch.zeros_like(v[:, :, :1])
    quantize = quantize_int8_blocks if qk_format == "int8" else quantize_fp8_blocks
    q_codes, q_scales = quantize(query, q_block, scale * LOG2E)
    k_codes, k_scales = quantize(k, k_block)
    if pv_format == "int8":
        v_codes, v_scales, v_mean = quantize_int8_channels_centred(v)
        p_mult = U8_MAX  # per tile, relative to its own max: the slack only bounds the tile's weight
    elif pv_format == "fp8":
        v_codes, v_scales = quantize_fp8_channels(v - v_mean)
        p_mult = FP8_MAX * 2.0**-rescale_slack
    else:
        v_codes, v_scales, p_mult = (v - v_mean).bfloat16(), torch.ones_like(v_mean), 2.0**-rescale_slack
    q8 = q_codes.float()
    q_row_scales = _per_row(q_scales, q_block, seq)
    k_col_scales = _per_row(k_scales, k_block, k.shape[2]).transpose(-1, -2)
    running_max = torch.full((batch, heads, seq, 1), float("-inf"), device=q8.device)
    running_sum = torch.zeros((batch, heads, seq, 1), device=q8.device)
    acc = torch.zeros((batch, heads, seq, head_dim), device=q8.device)
    for start in range(0, k.shape[2], K_TILE):
        keys = slice(start, start + K_TILE)
        logits = (q8 @ k_codes[:, :, keys].float().transpose(-1, -2)) * (q_row_scales * k_col_scales[..., keys])
        tile_max = logits.amax(dim=-1, keepdim=True)
        new_max = torch.where(tile_max > running_max + rescale_slack, tile_max, running_max)
        correction = torch.exp2(running_max - new_max)
        reference_max = tile_max if p_scale == "row" else new_max
        weight = torch.exp2(reference_max - new_max)  # 1 with the fixed scale
        probs = torch.exp2(logits - reference_max)
        p8 = _round_p(probs * p_mult, pv_format)
        tile_sum = probs.sum(dim=-1, keepdim=True) if row_sum == "exact" else p8.sum(dim=-1, keepdim=True) / p_mult
        running_sum = running_sum * correction + weight * tile_sum
        v8 = v_codes[:, :, keys].float()
        if pv_promote:
            acc = acc * correction + weight * _tile_pv(p8, v8, pv_accum_bits, torch.zeros_like(acc))
        else:
            acc = _tile_pv(p8, v8, pv_accum_bits, acc * correction)
        running_max = new_max
    out = acc / (running_sum * p_mult) * v_scales + v_mean
    out = out.transpose(1, 2).contiguous().view(batch, seq, heads * head_dim)
    if not return_lse:
        return out
    shift = scale * (query.float() @ k_mean.transpose(-1, -2))  # K smoothing took q . mean off the row's logits
    lse = (running_max + torch.log2(running_sum)) * math.log(2.0) + shift
    return out, lse.squeeze(-1).transpose(1, 2).contiguous()


KERNEL_SCHEME = {"rescale_slack": KERNEL_RESCALE_SLACK, "row_sum": "rounded"}
"""`int8_fp8_attention`'s options that are not its defaults in the kernel's scheme."""

INT8_PV_SCHEME = {"pv_format": "int8", "p_scale": "row", "q_block": 1, "rescale_slack": 8.0, "row_sum": "rounded"}
"""The "int8" kernel's scheme (`kernels/pv_u8.cuh`): Q per token, P as u8 codes per row and 128-key tile, V int8
about each channel's mid-range, the running max lagging by up to 8 log2 units (a tile's weight <= 256), l the
sum of the rounded codes."""

KERNEL_SCHEMES = {"fp8": KERNEL_SCHEME, "int8": INT8_PV_SCHEME}
"""8-bit kernel name -> `int8_fp8_attention`'s options of its scheme."""


def kernel_twin(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    return_lse: bool = False,
    key_lens: torch.Tensor | None = None,
    kernel: str = "fp8",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit kernel (`kernel`: "fp8" or "int8") in torch: `int8_fp8_attention` with that kernel's scheme
    (`KERNEL_SCHEMES`), batch by batch over the first `key_lens[b]` keys when given (a batch with none gets
    rows of 0 and LSE -inf, as the kernel writes).

    Returns token-major `[B, Nq, H*D]` float32, and with `return_lse` the LSE `[B, Nq, H]` float32.
    """
    scheme = KERNEL_SCHEMES[kernel]
    if key_lens is None:
        return int8_fp8_attention(query, key, value, scale, return_lse=return_lse, **scheme)
    outs, lses = [], []
    _, heads, seq, head_dim = query.shape
    for b, count in enumerate(key_lens.clamp(0, key.shape[2]).tolist()):
        if count == 0:
            outs.append(torch.zeros((1, seq, heads * head_dim), device=query.device))
            lses.append(torch.full((1, seq, heads), float("-inf"), device=query.device))
            continue
        rows = slice(b, b + 1)
        out, lse = int8_fp8_attention(
            query[rows], key[rows, :, :count], value[rows, :, :count], scale, return_lse=True, **scheme
        )
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out
