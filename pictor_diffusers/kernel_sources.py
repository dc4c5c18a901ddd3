"""Where the CUDA C sources live and which compiled variants exist.

The `.cu` files sit in the repository's top-level `kernels/` folder; the wheel
ships them as `pictor_diffusers/kernels/`. Each variant is one source compiled
with its own `-D` defines, so a variant is fully named by (file, defines).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent

F32_TILE_KEYS = 32
"""FA_BK in `flash_attn_f32.cu`: keys per shared-memory tile (K and V, f32)."""

F32_ROWS_PER_BLOCK = 8
"""FA_BQ in `flash_attn_f32.cu`: query rows per thread block."""

F32_THREADS = 128
"""FA_THREADS in `flash_attn_f32.cu`: threads per block (4 warps)."""


@dataclass(frozen=True)
class KernelVariant:
    """One compiled flavour of a kernel source.

    Attributes:
        name: short id, used in caches and test ids.
        source: file name inside `kernels/`.
        entry: the `extern "C"` kernel symbol.
        max_head_dim: largest head_dim the variant computes exactly.
        defines: preprocessor defines passed to NVRTC as `-D` options.
    """

    name: str
    source: str
    entry: str
    max_head_dim: int
    defines: tuple[tuple[str, str], ...]

    def options(self) -> tuple[str, ...]:
        """NVRTC options that select this variant (no arch flag)."""
        return tuple(f"-D{key}={value}" for key, value in self.defines)

    def shared_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory for one block at `head_dim`: the K and V tiles."""
        return 2 * F32_TILE_KEYS * head_dim * 4


def _f32_variant(max_head_dim: int) -> KernelVariant:
    return KernelVariant(
        name=f"f32_d{max_head_dim}",
        source="flash_attn_f32.cu",
        entry="joint_attention_flash_f32",
        max_head_dim=max_head_dim,
        defines=(("FA_DMAX", f"{max_head_dim}u"),),
    )


F32_VARIANTS: tuple[KernelVariant, ...] = (
    _f32_variant(128),
    _f32_variant(256),
    _f32_variant(384),
)
"""f32 variants by register budget: d128 (FLUX.2's head_dim), d256 (lean), d384 (wide)."""

MAX_HEAD_DIM = F32_VARIANTS[-1].max_head_dim


def f32_variant_for(head_dim: int) -> KernelVariant:
    """The smallest f32 variant whose register arrays hold `head_dim`."""
    for variant in F32_VARIANTS:
        if head_dim <= variant.max_head_dim:
            return variant
    raise ValueError(f"head_dim={head_dim} exceeds the widest kernel variant ({MAX_HEAD_DIM})")


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
