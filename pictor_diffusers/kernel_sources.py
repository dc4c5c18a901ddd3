"""Where the CUDA C sources live and which compiled variants exist.

The `.cu` files sit in the repository's top-level `kernels/` folder; the wheel
ships them as `pictor_diffusers/kernels/`. A variant is one source compiled
with its own `-D` defines, so (file, defines) names it fully.

Kernel families:
* `f32`: `flash_attn_f32.cu`, scalar FP32, the parity reference (any head_dim <= 384).
* `tf32x3`: `flash_attn_tf32x3.cu`, split-precision TF32 on tensor cores (sm_80+),
  head_dim in {32, 64, 96, 128}, writing f32, bf16 or f16 directly.
* `prologue`: `qkv_prologue.cu`, QK RMSNorm + RoPE + head-major f32 packing,
  reading the projections in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent

F32_TILE_KEYS = 32
"""FA_BK in `flash_attn_f32.cu`: keys per shared-memory tile (K and V, f32)."""

TF32X3_HEAD_DIMS = (32, 64, 96, 128)
TF32X3_TILE_KEYS = 32
TF32X3_OUT_KINDS = {"float32": 0, "bfloat16": 1, "float16": 2}


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
    """

    name: str
    source: str
    entry: str
    max_head_dim: int
    defines: tuple[tuple[str, str], ...]
    threads: int
    rows_per_block: int
    out_dtype: str = "float32"

    def options(self) -> tuple[str, ...]:
        """NVRTC options that select this variant (no arch flag)."""
        return tuple(f"-D{key}={value}" for key, value in self.defines)

    def shared_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of one block at `head_dim`."""
        if self.source == "flash_attn_f32.cu":
            return 2 * F32_TILE_KEYS * head_dim * 4
        if self.source == "qkv_prologue.cu":
            return 0
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


def prologue_variant_for(head_dim: int, in_dtype: str) -> KernelVariant:
    """The fused QK-norm / RoPE / head-major prologue for `head_dim` reading `in_dtype`."""
    if head_dim % 4 or not 4 <= head_dim <= 128:
        raise ValueError(f"the fused prologue needs head_dim a multiple of 4 in [4, 128], got {head_dim}")
    return KernelVariant(
        name=f"prologue_d{head_dim}_{in_dtype}",
        source="qkv_prologue.cu",
        entry="qkv_prologue",
        max_head_dim=head_dim,
        defines=(("PR_D", str(head_dim)), ("PR_IN_KIND", str(TF32X3_OUT_KINDS[in_dtype]))),
        threads=256,
        rows_per_block=1,
        out_dtype="float32",
    )


F32_VARIANTS: tuple[KernelVariant, ...] = (_f32_variant(128), _f32_variant(256), _f32_variant(384))
"""f32 variants by register budget: d128 (FLUX.2's head_dim), d256 (lean), d384 (wide)."""

TF32X3_VARIANTS: tuple[KernelVariant, ...] = tuple(
    _tf32x3_variant(d, out) for d in TF32X3_HEAD_DIMS for out in TF32X3_OUT_KINDS
)

PROLOGUE_VARIANTS: tuple[KernelVariant, ...] = tuple(prologue_variant_for(128, dtype) for dtype in TF32X3_OUT_KINDS)
"""The prologue at FLUX.2's head_dim for each model dtype (other head_dims compile on demand)."""

ALL_VARIANTS = F32_VARIANTS + TF32X3_VARIANTS + PROLOGUE_VARIANTS

MAX_HEAD_DIM = F32_VARIANTS[-1].max_head_dim


def f32_variant_for(head_dim: int) -> KernelVariant:
    """The smallest f32 variant whose register arrays hold `head_dim`."""
    for variant in F32_VARIANTS:
        if head_dim <= variant.max_head_dim:
            return variant
    raise ValueError(f"head_dim={head_dim} exceeds the widest kernel variant ({MAX_HEAD_DIM})")


def tf32x3_variant_for(head_dim: int, out_dtype: str) -> KernelVariant:
    """The tensor-core variant for exactly `head_dim` writing `out_dtype`."""
    if head_dim not in TF32X3_HEAD_DIMS:
        raise ValueError(f"the tf32x3 kernel needs head_dim in {TF32X3_HEAD_DIMS}, got {head_dim}")
    return _tf32x3_variant(head_dim, out_dtype)


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
