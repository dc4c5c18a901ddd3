"""The split prologue's builds on a machine without a GPU (NVRTC to PTX; ptxas where present).

The planes are bit for bit the prologue's f32 values run through the split only if both kernels do the same
f32 arithmetic: the same flags (no -ftz in either prologue nor the split), no flush-to-zero instruction but the
scales' exponentials, and only 16-bit planes and the maxima written. `test_kernel_compile.py` also builds
every split prologue variant for sm_80 and sm_90 (entry, defines, static_asserts, registers and spills).
"""

from __future__ import annotations

import re

import pytest
from compile_tools import needs_cupy, ptx_for

from pictor_diffusers.cuda.pass_rows import (
    PROLOGUE,
    PROLOGUE_SPLIT,
    SPLIT,
    prologue_split_variant,
    prologue_variant,
    split_variant,
)

IN_DTYPES = ("float32", "bfloat16", "float16")
SCALE_FTZ = {"ex2.approx.ftz.f32"}
"""The only flush-to-zero instruction the split may hold: the exponentials of `ldexpf(1, e)`, |e| <= 120."""


def _ftz_instructions(ptx: str) -> set[str]:
    return set(re.findall(r"\b[a-z0-9]+(?:\.[a-z0-9]+)*\.ftz(?:\.[a-z0-9]+)*", ptx))


def test_the_split_prologue_row_matches_the_prologue_and_the_split() -> None:
    assert PROLOGUE.flags == PROLOGUE_SPLIT.flags == SPLIT.flags == ()
    assert (PROLOGUE_SPLIT.threads, PROLOGUE_SPLIT.rows_per_block) == (SPLIT.threads, SPLIT.rows_per_block)
    assert PROLOGUE_SPLIT.in_dtypes == PROLOGUE.in_dtypes and PROLOGUE_SPLIT.head_dims == SPLIT.head_dims
    for in_dtype in IN_DTYPES:
        defines = dict(prologue_split_variant(128, in_dtype).defines())
        assert defines == {"PS_D": "128", "PS_IN_KIND": str(IN_DTYPES.index(in_dtype)), "PS_ROWS": "64",
                           "PS_THREADS": "256"}  # fmt: skip


@needs_cupy
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_same_float_arithmetic_without_flush_to_zero(in_dtype: str, arch: str) -> None:
    """Subnormals survive the prologue's math in both kernels and the split's scaling, as in the split kernel."""
    prologue = ptx_for(prologue_variant(128, in_dtype, "float32"), arch)
    fused = ptx_for(prologue_split_variant(128, in_dtype), arch)
    split = ptx_for(split_variant(128), arch)
    assert not _ftz_instructions(prologue), f"flush-to-zero in the prologue: {_ftz_instructions(prologue)}"
    assert _ftz_instructions(fused) <= SCALE_FTZ, f"flush-to-zero in the split prologue: {_ftz_instructions(fused)}"
    assert _ftz_instructions(fused) == _ftz_instructions(split)
    for instruction in ("rsqrt.approx.f32", "div.rn.f32", "add.rn.f32", "fma.rn.f32", "mul.rn.f32"):
        assert instruction in prologue and instruction in fused, f"{instruction} missing"


@needs_cupy
@pytest.mark.parametrize("in_dtype", IN_DTYPES)
def test_writes_only_the_planes_and_the_maxima(in_dtype: str) -> None:
    """No f32 store (no q, k, v round trip): 16-bit hi/lo pairs, and the maxima by atomicMax."""
    ptx = ptx_for(prologue_split_variant(128, in_dtype), "sm_90")
    stores = set(re.findall(r"\bst\.global(?:\.v[24])?\.(\w+)", ptx))
    assert stores <= {"u32", "b32"}, f"stores of {stores}"
    assert re.search(r"\batom\.global\.max\.u32\b", ptx), "no atomicMax of the column maxima"
    assert len(re.findall(r"\bcvt\.rn\.f16x2\.f32\b", ptx)) >= 4, "no float16 hi/lo conversions"
