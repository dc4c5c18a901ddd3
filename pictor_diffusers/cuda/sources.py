"""Where the CUDA C sources live: `kernels/*.cu` and the shared headers `kernels/*.cuh`.

The files sit in the repository's top-level `kernels/` folder; the wheel ships
them as `pictor_diffusers/kernels/`.
"""

from __future__ import annotations

import functools
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
HEADERS = (
    "common.cuh",
    "attention_io.cuh",
    "tile_schedule.cuh",
    "epilogue.cuh",
    "softmax.cuh",
    "quant_rows.cuh",
    "q8_scores.cuh",
    "pv_e4m3.cuh",
    "pv_u8.cuh",
    "fp16_split.cuh",
    "split_phases.cuh",
    "prologue_math.cuh",
    "sm80_mma.cuh",
    "sm90_pipeline.cuh",
    "sm90_wgmma.cuh",
    "sm90_store.cuh",
    "key_bias.cuh",
)
"""Headers a kernel may `#include "..."` (`common.cuh`'s opening comment gives each one's role);
NVRTC gets them all in memory."""


@functools.cache
def kernels_dir() -> Path:
    """The folder holding the `.cu` sources, for both wheels and source checkouts."""
    for candidate in (_PACKAGE_DIR / "kernels", _PACKAGE_DIR.parent / "kernels"):
        if (candidate / HEADERS[0]).is_file():
            return candidate
    raise FileNotFoundError(
        f"pictor-diffusers kernel sources not found next to {_PACKAGE_DIR}; "
        "the installation is incomplete (reinstall the wheel)."
    )


@functools.cache
def read_source(name: str) -> str:
    """The CUDA C text of `kernels/<name>` (read once per process)."""
    return (kernels_dir() / name).read_text(encoding="utf-8")


def header_texts() -> tuple[str, ...]:
    """The texts of `HEADERS`, in order."""
    return tuple(read_source(name) for name in HEADERS)
