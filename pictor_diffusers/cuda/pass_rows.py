"""The registry's second table: the rows of the prologues and the prepasses, and their builds.

The prologues turn FLUX.2's projections into an attention kernel's inputs (`PROLOGUE`: f32 or 16-bit q, k, v;
`PROLOGUE_SPLIT`: the fp16x3 kernel's split planes); the prepasses turn q, k, v into a kernel's operands
(`SPLIT` for "split_planes", `QUANTIZE` for "quantized"; `prepass_for` says which a build needs). Rows and pure
lookups only, as in `registry.py`, whose `KernelSpec` and `Variant` they use.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..dtypes import HALF_DTYPES, KINDS
from .registry import KernelSpec, Variant

_PASS = {"min_capability": (5, 0), "threads": 256, "shared_bytes": lambda d: 0, "smem_define": False, "flags": ()}
"""What the prologues and prepasses share: any GPU, 8 warps, no dynamic shared memory, no -ftz (the prologues'
f32 math must agree bit for bit, and the split keeps subnormals)."""

PROLOGUE = KernelSpec(
    name="prologue",
    family="prologue",
    source="qkv_prologue.cu",
    entry="qkv_prologue",
    in_dtypes=tuple(KINDS),
    out_dtypes=tuple(KINDS),
    head_dims=tuple(range(4, 129, 4)),
    rows_per_block=1,
    prefix="PR_",
    geometry={"THREADS": "256"},
    kinds=("IN_KIND", "OUT_KIND"),
    scalars=(),
    **_PASS,
)
"""The fused QK-norm / RoPE / head-major prologue (grid: one block per token and batch)."""

PROLOGUE_SPLIT = replace(
    PROLOGUE,
    name="prologue_split",
    source="qkv_prologue_split.cu",
    entry="qkv_prologue_split",
    out_dtypes=("float16",),
    head_dims=(128,),
    rows_per_block=64,
    prefix="PS_",
    geometry={"ROWS": "64", "THREADS": "256"},
    kinds=("IN_KIND",),
)
"""The parity path's prologue writing fp16x3's split planes and column maxima (two phases; `SPLIT`'s grid)."""


SPLIT = KernelSpec(
    name="split",
    family="prepass",
    source="split_fp16x2.cu",
    entry="split_fp16x2",
    in_dtypes=("float32",),
    out_dtypes=("float16",),
    head_dims=(128,),
    rows_per_block=64,
    prefix="SP_",
    geometry={"ROWS": "64", "THREADS": "256"},
    scalars=("seq_q", "seq_k", "q_pitch", "kv_pitch"),
    **_PASS,
)
"""The fp16x3 kernel's prepass: f32 q, k, v -> scaled float16 hi/lo planes (two phases, one entry)."""


QUANTIZE = KernelSpec(
    name="quantize8",
    family="prepass",
    source="quantize_qkv8.cu",
    entry="quantize_qkv8",
    in_dtypes=HALF_DTYPES,
    out_dtypes=("int8",),
    head_dims=(128,),
    rows_per_block=128,
    prefix="QZ_",
    geometry={"THREADS": "256", "CHUNKS": "16", "PV": "0"},
    kinds=("IN_KIND",),
    scalars=("seq_q", "seq_k", "q_pitch", "kv_pitch", "heads", "scale_log2"),
    **{**_PASS, "min_capability": (8, 9)},
)
"""The "fp8" kernel's prepass: 16-bit q, k, v -> int8 q (a scale per 64 rows), smoothed int8 k, E4M3 V^T
and their scales (two phases, one entry)."""

QUANTIZE_U8 = replace(QUANTIZE, name="quantize8_u8", geometry={**QUANTIZE.geometry, "PV": "1"})
"""The "int8" kernel's prepass: as `QUANTIZE`, but q with a scale per row and V^T as int8 about each
channel's mid-range (a step and a centre per channel)."""


@functools.cache
def quantize_variant(head_dim: int, in_dtype: str, pv: str) -> Variant:
    """The quantising prepass build for `head_dim` (128), `in_dtype` (bfloat16 or float16) inputs and the
    8-bit kernel's P.V scheme `pv` (its geometry's "PV": "0" E4M3, "1" u8 x int8)."""
    rows = {"0": QUANTIZE, "1": QUANTIZE_U8}
    if pv not in rows:
        raise ValueError(f"pv must be one of {tuple(rows)}, got {pv!r}")
    return Variant(rows[pv], head_dim, in_dtype, "int8")


@functools.cache
def split_variant(head_dim: int) -> Variant:
    """The split build for `head_dim` (128, the fp16x3 kernel's)."""
    return Variant(SPLIT, head_dim, "float32", "float16")


@functools.cache
def prologue_variant(head_dim: int, in_dtype: str, out_dtype: str) -> Variant:
    """The prologue build for `head_dim`, reading `in_dtype` projections and writing `out_dtype`."""
    if head_dim not in PROLOGUE.head_dims:
        raise ValueError(f"the fused prologue needs head_dim a multiple of 4 in [4, 128], got {head_dim}")
    return Variant(PROLOGUE, head_dim, in_dtype, out_dtype)


@functools.cache
def prologue_split_variant(head_dim: int, in_dtype: str) -> Variant:
    """The split prologue build for `head_dim` (128, the fp16x3 kernel's), reading `in_dtype` projections."""
    if head_dim not in PROLOGUE_SPLIT.head_dims:
        raise ValueError(f"the split prologue needs head_dim {PROLOGUE_SPLIT.head_dims}, got {head_dim}")
    return Variant(PROLOGUE_SPLIT, head_dim, in_dtype, "float16")


def prepass_for(variant: Variant) -> Variant | None:
    """The prepass build that turns q, k, v into `variant`'s operands: the split for "split_planes", the
    quantiser for "quantized"; None for a kernel that reads them as they are."""
    if variant.spec.operands == "split_planes":
        return split_variant(variant.head_dim)
    if variant.spec.operands == "quantized":
        return quantize_variant(variant.head_dim, variant.in_dtype, variant.spec.geometry["PV"])
    return None
