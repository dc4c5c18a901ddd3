"""The host passes every attention kernel the arguments its entry point declares (no GPU needed).

`launch` builds a launch's argument array from the registry row (`_signature`: the operand kinds, then the
scalars); the kernel's parameters are in its source. A mismatch compiles and then reads garbage on the GPU, so
each build's PTX entry is compared with the host's signature: a tensor map is a 128-byte by-value parameter
(None on the host), device addresses u64, counts u32, the scale f32.
"""

from __future__ import annotations

import ctypes
import re

import pytest
from compile_tools import needs_cupy, ptx_for

from pictor_diffusers.cuda import launch
from pictor_diffusers.cuda.geometry import OUT_MAP_OPERAND, OUT_OPERAND
from pictor_diffusers.cuda.registry import BY_NAME, KERNELS, Variant, variants

PTX_PARAM = {None: ("b8", 128), ctypes.c_uint64: ("u64", None), ctypes.c_uint32: ("u32", None),
             ctypes.c_float: ("f32", None), ctypes.c_int32: ("s32", None)}  # fmt: skip
BUILDS = [v for spec in KERNELS for v in variants(spec) if v.head_dim == max(spec.head_dims) and not v.key_lens]


def entry_params(variant: Variant) -> list[tuple[str, int | None]]:
    """(PTX type, byte-array length or None) of each parameter of the build's entry point."""
    arch = variant.arch((9, 0)) if variant.spec.arch_suffix else "sm_80"
    ptx = ptx_for(variant, arch)
    entry = re.search(rf"\.entry\s+{variant.spec.entry}\s*\((.*?)\)", ptx, re.S)
    assert entry is not None, f"{variant.name}: no entry {variant.spec.entry} in the PTX"
    params = re.findall(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+\w+(?:\[(\d+)\])?", entry.group(1))
    return [(kind, int(length) if length else None) for kind, length in params]


@needs_cupy
@pytest.mark.parametrize("variant", BUILDS, ids=lambda v: v.name)
def test_host_signature_matches_the_kernel_entry(variant: Variant) -> None:
    expected = [PTX_PARAM[kind] for kind in launch._signature(variant.spec)]
    assert entry_params(variant) == expected, f"{variant.name}: host signature and kernel parameters differ"


def test_the_output_operands_are_where_the_launches_write_them() -> None:
    for spec in KERNELS:
        assert launch._signature(spec)[OUT_OPERAND] is ctypes.c_uint64, spec.name
    wgmma = launch._signature(BY_NAME["wgmma"])
    assert wgmma[OUT_MAP_OPERAND] is None, "the wgmma kernel stores through a map of its output"
