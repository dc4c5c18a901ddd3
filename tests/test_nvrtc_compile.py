"""The f32 kernel compiles for sm_80 and sm_90 on a machine without a GPU.

Every variant of `kernel_sources.F32_VARIANTS` goes through NVRTC (via CuPy's
bindings; no driver needed) to PTX, which must hold the entry point and no
tensor-core or 16-bit instructions: this is the parity-first all-f32 kernel.
Where `ptxas` is on PATH the PTX is assembled and its resource report parsed:
the d128 variant (FLUX.2's head_dim) must not spill or use a stack frame.
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest
from compile_tools import needs_cupy, parse_resources, ptx_for, ptxas_report

from pictor_diffusers import kernel_sources
from pictor_diffusers.kernel_sources import F32_VARIANTS, KernelVariant, f32_variant_for

ARCHS = ["sm_80", "sm_90"]
VARIANT_IDS = [variant.name for variant in F32_VARIANTS]
STRICT_NO_SPILL = {"f32_d128"}


@needs_cupy
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", F32_VARIANTS, ids=VARIANT_IDS)
def test_compiles_to_ptx(variant: KernelVariant, arch: str) -> None:
    ptx = ptx_for(variant, arch)
    assert f".entry {variant.entry}" in ptx
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.MULTILINE), f"PTX is not for {arch}"


@needs_cupy
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", F32_VARIANTS, ids=VARIANT_IDS)
def test_ptx_is_f32_only(variant: KernelVariant, arch: str) -> None:
    ptx = ptx_for(variant, arch)
    tensor_core = sorted(set(re.findall(r"\b(?:wgmma|wmma|mma)\.[\w.]+", ptx)))
    assert not tensor_core, f"tensor-core instructions in the parity kernel: {tensor_core[:5]}"
    sixteen_bit = sorted(set(re.findall(r"\S*\.b?f16\S*", ptx)))
    assert not sixteen_bit, f"16-bit staging in the parity kernel: {sixteen_bit[:5]}"
    assert re.search(r"\bfma\.rn\.f32\b", ptx), "no f32 FMA in the PTX"


@needs_cupy
@pytest.mark.parametrize("arch", ARCHS)
def test_variants_differ(arch: str) -> None:
    """The FA_DMAX define reaches NVRTC: each variant compiles to different code."""
    ptxs = {variant.name: ptx_for(variant, arch) for variant in F32_VARIANTS}
    assert len(set(ptxs.values())) == len(ptxs), "two variants compiled to identical PTX"


@needs_cupy
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", F32_VARIANTS, ids=VARIANT_IDS)
def test_ptxas_resources(variant: KernelVariant, arch: str, tmp_path: Path) -> None:
    resources = parse_resources(ptxas_report(ptx_for(variant, arch), arch, tmp_path))
    print(f"{variant.name} {arch}: {resources}")
    assert 0 < resources["registers"] <= 255
    if variant.name in STRICT_NO_SPILL:
        spills = {key: resources[key] for key in ("stack_frame", "spill_stores", "spill_loads")}
        assert not any(spills.values()), f"{variant.name} on {arch} spills or uses a stack frame: {spills}"
    elif resources["spill_stores"] or resources["spill_loads"] or resources["stack_frame"]:
        warnings.warn(f"{variant.name} on {arch} spills or uses a stack frame: {resources}", stacklevel=1)


# The 3xTF32 tensor-core kernel: it must compile for both archs, really use TF32 mma,
# fit one block's registers and never spill.
TF32X3_VARIANTS = kernel_sources.TF32X3_VARIANTS
PROLOGUE_VARIANTS = kernel_sources.PROLOGUE_VARIANTS


@needs_cupy
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", TF32X3_VARIANTS, ids=[v.name for v in TF32X3_VARIANTS])
def test_tf32x3_compiles(variant: KernelVariant, arch: str, tmp_path: Path) -> None:
    ptx = ptx_for(variant, arch)
    assert f".entry {variant.entry}" in ptx
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.MULTILINE), f"PTX is not for {arch}"
    assert re.search(r"\bmma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32\b", ptx), "no TF32 mma"
    if shutil.which("ptxas") is None:
        return
    resources = parse_resources(ptxas_report(ptx, arch, tmp_path))
    print(f"{variant.name} {arch}: {resources}")
    assert resources["registers"] * variant.threads <= 65536, f"one block does not fit the register file: {resources}"
    spills = {key: resources[key] for key in ("stack_frame", "spill_stores", "spill_loads")}
    assert not any(spills.values()), f"{variant.name} on {arch} spills or uses a stack frame: {spills}"


@needs_cupy
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", PROLOGUE_VARIANTS, ids=[v.name for v in PROLOGUE_VARIANTS])
def test_prologue_compiles_without_spills(variant: KernelVariant, arch: str, tmp_path: Path) -> None:
    ptx = ptx_for(variant, arch)
    assert f".entry {variant.entry}" in ptx
    if shutil.which("ptxas") is None:
        return
    resources = parse_resources(ptxas_report(ptx, arch, tmp_path))
    assert not resources["spill_stores"] and not resources["stack_frame"], resources


def test_tf32x3_shared_memory_matches_the_kernel() -> None:
    """The host's shared-memory size must equal FT_SMEM_BYTES of the .cu file."""
    text = (kernel_sources.kernels_dir() / "flash_attn_tf32x3.cu").read_text()
    macros = dict(re.findall(r"#define (FT_BQ|FT_BK) (\d+)", text))
    assert (int(macros["FT_BQ"]), int(macros["FT_BK"])) == (128, kernel_sources.TF32X3_TILE_KEYS)
    d = 128
    expected = (128 * (d + 4) + 32 * (d + 4) + 32 * (d + 2)) * 8 + 32 * d * 4
    assert kernel_sources.tf32x3_variant_for(d, "float32").shared_bytes(d) == expected


def test_kernels_dir_holds_the_source() -> None:
    folder = kernel_sources.kernels_dir()
    assert (folder / "flash_attn_f32.cu").is_file()
    for variant in F32_VARIANTS:
        source = kernel_sources.read_source(variant)
        assert f'extern "C" __global__ void {variant.entry}(' in source


@pytest.mark.parametrize("variant", F32_VARIANTS, ids=VARIANT_IDS)
def test_host_constants_match_kernel(variant: KernelVariant) -> None:
    """The launch geometry the host uses is the one the kernel source was written for."""
    source = kernel_sources.read_source(variant)
    expected = {
        "FA_BQ": variant.rows_per_block,
        "FA_BK": kernel_sources.F32_TILE_KEYS,
        "FA_THREADS": variant.threads,
    }
    for macro, value in expected.items():
        match = re.search(rf"^#define {macro} (\d+)u\b", source, re.MULTILINE)
        assert match is not None, f"#define {macro} not found in {variant.source}"
        assert int(match.group(1)) == value, f"{macro}={match.group(1)} in the kernel, {value} on the host"


@pytest.mark.parametrize(
    ("head_dims", "expected"),
    [((1, 31, 64, 100, 128), "f32_d128"), ((129, 200, 256), "f32_d256"), ((257, 300, 384), "f32_d384")],
    ids=["d128", "d256", "d384"],
)
def test_f32_variant_for(head_dims: tuple[int, ...], expected: str) -> None:
    for head_dim in head_dims:
        variant = f32_variant_for(head_dim)
        assert variant.name == expected, f"head_dim={head_dim} -> {variant.name}"
        assert head_dim <= variant.max_head_dim
        assert variant.options() == (f"-DFA_DMAX={variant.max_head_dim}u",)
        assert variant.shared_bytes(head_dim) == 2 * kernel_sources.F32_TILE_KEYS * head_dim * 4


@pytest.mark.parametrize("head_dim", [385, 1000])
def test_f32_variant_for_too_wide(head_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"head_dim={head_dim} exceeds the widest kernel variant \(384\)"):
        f32_variant_for(head_dim)
