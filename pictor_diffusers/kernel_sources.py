"""Where the CUDA C sources live and which compiled variants exist.

The `.cu` files sit in the repository's top-level `kernels/` folder; the wheel
ships them as `pictor_diffusers/kernels/`. A variant is one source compiled
with its own `-D` defines, so (file, defines) names it fully.

Kernel families:
* `f32`: `flash_attn_f32.cu`, scalar FP32, the parity reference (any head_dim <= 384).
* `tf32x3`: `flash_attn_tf32x3.cu`, split-precision TF32 on tensor cores (sm_80+),
  head_dim in {32, 64, 96, 128}, writing f32, bf16 or f16 directly.
* `wgmma`: `flash_attn_wgmma.cu`, bf16/fp16 on Hopper's warpgroup tensor cores
  (sm_90a; TMA, mbarriers, warp specialisation), head_dim 128; compiled to a
  cubin (see `nvrtc.cached_cubin`).
* `mma16`: `flash_attn_mma16.cu`, bf16/fp16 on mma.sync tensor cores (sm_80+),
  the portable 16-bit kernel.
* `prologue`: `qkv_prologue.cu`, QK RMSNorm + RoPE + head-major packing (f32 or
  16-bit), reading the projections in the model dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent

F32_TILE_KEYS = 32
"""FA_BK in `flash_attn_f32.cu`: keys per shared-memory tile (K and V, f32)."""

TF32X3_HEAD_DIMS = (32, 64, 96, 128)
TF32X3_TILE_KEYS = 32
TF32X3_OUT_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}
HALF_KINDS = {"bfloat16": 1, "float16": 2}
"""16-bit dtypes of the fast path, by the kind number the kernels' -D options use."""

WGMMA_HEAD_DIMS = (128,)
WGMMA_ARCH = "sm_90a"
WGMMA_STAGES = 3
MMA16_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class KernelVariant:
    """One compiled flavour of a kernel source.

    Attributes:
        name: short id, used in caches and test ids.
        source: file name inside `kernels/`.
        entry: the `extern "C"` kernel symbol.
        max_head_dim: largest head_dim the variant computes exactly.
        defines: preprocessor defines passed to NVRTC as `-D` options.
        threads: threads per block.
        rows_per_block: query rows per block (grid x = ceil(seq / rows_per_block)).
        out_dtype: dtype name of the output the kernel writes.
        smem_bytes: dynamic shared memory per block, where fixed by the build.
        arch: the exact target ("sm_90a") for kernels compiled to a cubin;
            empty for those CuPy compiles for the device at hand.
    """

    name: str
    source: str
    entry: str
    max_head_dim: int
    defines: tuple[tuple[str, str], ...]
    threads: int
    rows_per_block: int
    out_dtype: str = "float32"
    smem_bytes: int = 0
    arch: str = ""

    def options(self) -> tuple[str, ...]:
        """NVRTC options that select this variant (no arch flag)."""
        return tuple(f"-D{key}={value}" for key, value in self.defines)

    def shared_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of one block at `head_dim`."""
        if self.source == "flash_attn_f32.cu":
            return 2 * F32_TILE_KEYS * head_dim * 4
        if self.source != "flash_attn_tf32x3.cu":
            return self.smem_bytes
        d = self.max_head_dim
        pairs = self.rows_per_block * (d + 4) + TF32X3_TILE_KEYS * (d + 4) + TF32X3_TILE_KEYS * (d + 2)
        raw_v_tile = TF32X3_TILE_KEYS * d * 4
        return pairs * 8 + raw_v_tile


def _f32_variant(max_head_dim: int) -> KernelVariant:
    return KernelVariant(
        name=f"f32_d{max_head_dim}",
        source="flash_attn_f32.cu",
        entry="joint_attention_flash_f32",
        max_head_dim=max_head_dim,
        defines=(("FA_DMAX", f"{max_head_dim}u"),),
        threads=128,
        rows_per_block=8,
    )


def _tf32x3_variant(head_dim: int, out_dtype: str) -> KernelVariant:
    return KernelVariant(
        name=f"tf32x3_d{head_dim}_{out_dtype}",
        source="flash_attn_tf32x3.cu",
        entry="joint_attention_tf32x3",
        max_head_dim=head_dim,
        defines=(("FT_D", str(head_dim)), ("FT_OUT_KIND", str(TF32X3_OUT_KINDS[out_dtype]))),
        threads=256,
        rows_per_block=128,
        out_dtype=out_dtype,
    )


def _wgmma_variant(head_dim: int, dtype: str) -> KernelVariant:
    return KernelVariant(
        name=f"wgmma_d{head_dim}_{dtype}",
        source="flash_attn_wgmma.cu",
        entry="joint_attention_wgmma",
        max_head_dim=head_dim,
        defines=(("WG_D", str(head_dim)), ("WG_IN_KIND", str(HALF_KINDS[dtype]))),
        threads=384,
        rows_per_block=128,
        out_dtype=dtype,
        smem_bytes=1024 + (1 + 2 * WGMMA_STAGES) * 128 * head_dim * 2 + 8 * (1 + 4 * WGMMA_STAGES),
        arch=WGMMA_ARCH,
    )


def _mma16_variant(head_dim: int, dtype: str) -> KernelVariant:
    return KernelVariant(
        name=f"mma16_d{head_dim}_{dtype}",
        source="flash_attn_mma16.cu",
        entry="joint_attention_mma16",
        max_head_dim=head_dim,
        defines=(("MH_D", str(head_dim)), ("MH_IN_KIND", str(HALF_KINDS[dtype]))),
        threads=MMA16_THREADS,
        rows_per_block=MMA16_ROWS,
        out_dtype=dtype,
        smem_bytes=mma16_shared_bytes(head_dim),
    )


MMA16_THREADS = 128
MMA16_ROWS = 128
MMA16_TILE_KEYS = 64


def mma16_shared_bytes(head_dim: int) -> int:
    """MH_SMEM_BYTES of `flash_attn_mma16.cu`: Q, K and V tiles in rows padded by 16 bytes."""
    return (MMA16_ROWS + 2 * MMA16_TILE_KEYS) * (2 * head_dim + 16)


def prologue_variant_for(head_dim: int, in_dtype: str, out_dtype: str = "float32") -> KernelVariant:
    """The fused QK-norm / RoPE / head-major prologue for `head_dim`, `in_dtype` -> `out_dtype`."""
    if head_dim % 4 or not 4 <= head_dim <= 128:
        raise ValueError(f"the fused prologue needs head_dim a multiple of 4 in [4, 128], got {head_dim}")
    suffix = "" if out_dtype == "float32" else f"_to_{out_dtype}"
    return KernelVariant(
        name=f"prologue_d{head_dim}_{in_dtype}{suffix}",
        source="qkv_prologue.cu",
        entry="qkv_prologue",
        max_head_dim=head_dim,
        defines=(
            ("PR_D", str(head_dim)),
            ("PR_IN_KIND", str(TF32X3_OUT_KINDS[in_dtype])),
            ("PR_OUT_KIND", str(TF32X3_OUT_KINDS[out_dtype])),
        ),
        threads=256,
        rows_per_block=1,
        out_dtype=out_dtype,
    )


F32_VARIANTS: tuple[KernelVariant, ...] = (_f32_variant(128), _f32_variant(256), _f32_variant(384))
"""f32 variants by register budget: d128 (FLUX.2's head_dim), d256 (lean), d384 (wide)."""

TF32X3_VARIANTS: tuple[KernelVariant, ...] = tuple(
    _tf32x3_variant(d, out) for d in TF32X3_HEAD_DIMS for out in TF32X3_OUT_KINDS
)

WGMMA_VARIANTS: tuple[KernelVariant, ...] = tuple(_wgmma_variant(d, t) for d in WGMMA_HEAD_DIMS for t in HALF_KINDS)
MMA16_VARIANTS: tuple[KernelVariant, ...] = tuple(_mma16_variant(d, t) for d in MMA16_HEAD_DIMS for t in HALF_KINDS)

PROLOGUE_VARIANTS: tuple[KernelVariant, ...] = tuple(
    prologue_variant_for(128, dtype, out) for dtype in TF32X3_OUT_KINDS for out in dict.fromkeys(("float32", dtype))
)
"""The prologue at FLUX.2's head_dim for each model dtype, to f32 and to that dtype
(other head_dims compile on demand)."""

PTX_VARIANTS = F32_VARIANTS + TF32X3_VARIANTS + MMA16_VARIANTS + PROLOGUE_VARIANTS
"""Variants CuPy compiles for the device at hand (any sm_80+ PTX target)."""

ALL_VARIANTS = PTX_VARIANTS + WGMMA_VARIANTS

MAX_HEAD_DIM = F32_VARIANTS[-1].max_head_dim


def f32_variant_for(head_dim: int) -> KernelVariant:
    """The smallest f32 variant whose register arrays hold `head_dim`."""
    for variant in F32_VARIANTS:
        if head_dim <= variant.max_head_dim:
            return variant
    raise ValueError(f"head_dim={head_dim} exceeds the widest kernel variant ({MAX_HEAD_DIM})")


@functools.cache
def tf32x3_variant_for(head_dim: int, out_dtype: str) -> KernelVariant:
    """The tensor-core variant for exactly `head_dim` writing `out_dtype`."""
    if head_dim not in TF32X3_HEAD_DIMS:
        raise ValueError(f"the tf32x3 kernel needs head_dim in {TF32X3_HEAD_DIMS}, got {head_dim}")
    return _tf32x3_variant(head_dim, out_dtype)


@functools.cache
def wgmma_variant_for(head_dim: int, dtype: str) -> KernelVariant:
    """The Hopper 16-bit variant for exactly `head_dim` and `dtype` ("bfloat16" / "float16")."""
    if head_dim not in WGMMA_HEAD_DIMS:
        raise ValueError(f"the wgmma kernel needs head_dim in {WGMMA_HEAD_DIMS}, got {head_dim}")
    return _wgmma_variant(head_dim, dtype)


@functools.cache
def mma16_variant_for(head_dim: int, dtype: str) -> KernelVariant:
    """The portable 16-bit variant for exactly `head_dim` and `dtype` ("bfloat16" / "float16")."""
    if head_dim not in MMA16_HEAD_DIMS:
        raise ValueError(f"the mma16 kernel needs head_dim in {MMA16_HEAD_DIMS}, got {head_dim}")
    return _mma16_variant(head_dim, dtype)


def kernels_dir() -> Path:
    """The folder holding the `.cu` sources, for both wheels and source checkouts."""
    for candidate in (_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels"):
        if (candidate / "flash_attn_f32.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"pictor-diffusers kernel sources not found next to {_PACKAGE_DIR}; "
        "the installation is incomplete (reinstall the wheel)."
    )


def read_source(variant: KernelVariant) -> str:
    """The CUDA C text of `variant`'s source file."""
    return (kernels_dir() / variant.source).read_text(encoding="utf-8")
