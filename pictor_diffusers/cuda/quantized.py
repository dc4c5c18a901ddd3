"""The 8-bit kernel's operands: the quantising prepass (`kernels/quantize_qkv8.cu`) and maps of its codes.

`quantized_operands` runs the prepass's two phases on a launch window's 16-bit q, k, v (contiguous head-major
`[B, H, N, 128]`, first-row addresses) into one workspace allocation, then encodes byte tensor maps of the
codes for `flash_attn_fp8.cu`. In its P.V scheme "0" (the "fp8" kernel):

    q8      int8  [B*H, Nq, 128]           q_scale  f32 [B*H, ceil(Nq / 64)]   (logit scale * log2 e folded in)
    k8      int8  [B*H, Nk, 128] smoothed  k_scale  f32 [B*H, ceil(Nk / 128)]
    vt8     E4M3  [B*H, 128, k_pad]        v_scale  f32 [B*H, 128]             (k_pad = 128 ceil(Nk / 128))
    q_shift f32   [B*H, Nq]                (scale log2 e q . mu: K smoothing's shift of the row's logits)
    partial f32   [2, B*H, CHUNKS, 128]    (phase 0's per-chunk key sums and value maxima)

In scheme "1" (the "int8" kernel) q_scale is `[B*H, Nq]` (one per row), vt8 int8 about each channel's mid-range
with v_scale `[B*H, 2, 128]` (step, centre), and partial `[3, B*H, CHUNKS, 128]` (key sums, max v, max -v).

With per-batch key counts, only each batch's attended keys enter K's mean, the scales and the codes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import runtime, tensor_maps
from .geometry import Geometry
from .pass_rows import QUANTIZE

TILE, Q_BLOCK = 128, 64
PV_SCHEMES = ("0", "1")
"""The P.V schemes (the 8-bit rows' geometry "PV"): "0" E4M3 (the "fp8" kernel), "1" u8 x int8 ("int8")."""
CHUNKS = int(QUANTIZE.geometry["CHUNKS"])
_ALIGN = 256
_U32, _U64, _F32 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_SIGNATURE = (_U64,) * 12 + (_U32,) * 5 + (_F32, _U32)


def workspace_layout(planes: int, q_count: int, k_count: int, head_dim: int, pv: str) -> dict[str, tuple[int, int]]:
    """name -> (byte offset, byte size) of each prepass output in the workspace of P.V scheme `pv` (one of
    `PV_SCHEMES`), each 256-byte aligned."""
    if pv not in PV_SCHEMES:
        raise ValueError(f"pv must be one of {PV_SCHEMES}, got {pv!r}")
    k_tiles, u8 = -(-k_count // TILE), pv == "1"
    sizes = {
        "q8": planes * q_count * head_dim,
        "k8": planes * k_count * head_dim,
        "vt8": planes * head_dim * k_tiles * TILE,
        "q_scale": 4 * planes * (q_count if u8 else -(-q_count // Q_BLOCK)),
        "k_scale": 4 * planes * k_tiles,
        "v_scale": 4 * planes * head_dim * (2 if u8 else 1),
        "q_shift": 4 * planes * q_count,
        "partial": 4 * (3 if u8 else 2) * planes * CHUNKS * head_dim,
    }
    layout, offset = {}, 0
    for name, size in sizes.items():
        layout[name] = (offset, size)
        offset += -(-size // _ALIGN) * _ALIGN
    return layout


def quantize(
    pointers: tuple[int, int, int], g: Geometry, device_index: int, function: int, pv: str, key_lens: int = 0
) -> tuple[torch.Tensor, dict[str, int]]:
    """Run the prepass (`function`: its loaded `CUfunction` handle, `pass_rows.quantize_variant`'s for P.V
    scheme `pv`) on the window's q, k, v (`pointers`, `g`; `key_lens`: the address of per-batch key counts, or
    0); returns the workspace (uint8, keep it referenced until the attention launch is issued) and each
    output's address."""
    layout = workspace_layout(g.planes, g.q_count, g.k_count, g.head_dim, pv)
    last_offset, last_size = layout["partial"]
    workspace = torch.empty(last_offset + last_size, dtype=torch.uint8, device=torch.device("cuda", device_index))
    at = {name: workspace.data_ptr() + offset for name, (offset, _) in layout.items()}
    outputs = tuple(at[name] for name in ("q8", "k8", "vt8", "q_scale", "k_scale", "v_scale", "q_shift", "partial"))
    scalars = (g.q_count, g.k_count, g.q_pitch, g.kv_pitch, g.heads, g.scale_log2)
    tiles = max(-(-g.q_count // TILE), -(-g.k_count // TILE))
    for phase, grid in ((0, (g.planes, CHUNKS, 1)), (1, (g.planes, tiles, 1))):
        args = (*pointers, key_lens, *outputs, *scalars, phase)
        runtime.launch(function, device_index, grid, QUANTIZE.threads, 0, _SIGNATURE, args)
    return workspace, at


def _code_maps(at: dict[str, int], g: Geometry) -> list[tuple[ctypes.Array, int]]:
    """Byte maps of q8, k8 (rows = tokens) and vt8 (rows = channels, inner = k_pad keys), heads x batches."""
    heads, batches, d = g.heads, g.planes // g.heads, g.head_dim
    k_pad = -(-g.k_count // TILE) * TILE

    def rows(address: int, count: int, inner: int) -> tensor_maps.Planes:
        return tensor_maps.Planes(address, heads, count, batches, count * inner, inner, heads * count * inner)

    return [
        tensor_maps.map_at(rows(at["q8"], g.q_count, d), d, torch.uint8),
        tensor_maps.map_at(rows(at["k8"], g.k_count, d), d, torch.uint8),
        tensor_maps.map_at(rows(at["vt8"], d, k_pad), k_pad, torch.uint8),
    ]


def quantized_operands(
    pointers: tuple[int, ...], g: Geometry, device_index: int, function: int, pv: str
) -> tuple[tuple[Any, ...], object]:
    """(operand values, what must stay referenced until the launch) of the "quantized" operand kind in P.V
    scheme `pv`, from the window's (q, k, v, out, lse, key_lens) addresses: the prepass (`function`), then maps
    of its codes."""
    workspace, at = quantize(pointers[:3], g, device_index, function, pv, key_lens=pointers[5])
    maps = _code_maps(at, g)
    addresses = tuple(address for _, address in maps)
    scales = (at["q_scale"], at["k_scale"], at["v_scale"], at["q_shift"])
    return (*addresses, *pointers[3:], *scales), (maps, workspace)
