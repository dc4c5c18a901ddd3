"""The 16-bit attention kernels compile on a machine without a GPU.

* mma16 (`MMA16_VARIANTS`): NVRTC PTX for sm_80 and sm_90 holding the entry and
  the 16-bit `mma.sync.m16n8k16` of its dtype; ptxas: no spills, no stack frame,
  one block fits the register file.
* wgmma (`WGMMA_VARIANTS`): a cubin for sm_90a (`compile_cubin`, an ELF file) and
  PTX for sm_90a with `wgmma.mma_async` of its dtype; ptxas: no spills. Where
  `cuobjdump` or `nvdisasm` is found (PATH, or beside ptxas), the cubin's SASS
  must hold HGMMA and its resource usage no local memory.
* The launch constants the host uses (threads, rows per block, shared memory)
  are checked by the compiler itself: static_asserts appended to the source.

Tests skip with the reason when CuPy (NVRTC), ptxas or a disassembler is absent.
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
from pathlib import Path

import pytest
from compile_tools import needs_cupy, needs_ptxas, parse_resources, ptx_for, ptxas_report, sass_tool, spills

from pictor_diffusers import kernel_sources
from pictor_diffusers.kernel_sources import (
    MMA16_VARIANTS,
    WGMMA_VARIANTS,
    KernelVariant,
    mma16_variant_for,
    wgmma_variant_for,
)

MMA16_ARCHS = ["sm_80", "sm_90"]
WGMMA_ARCH = "sm_90a"
PTX_TYPE = {"bfloat16": "bf16", "float16": "f16"}


def _ids(variants: tuple[KernelVariant, ...]) -> list[str]:
    return [variant.name for variant in variants]


@needs_cupy
@pytest.mark.parametrize("arch", MMA16_ARCHS)
@pytest.mark.parametrize("variant", MMA16_VARIANTS, ids=_ids(MMA16_VARIANTS))
def test_mma16_ptx(variant: KernelVariant, arch: str) -> None:
    ptx = ptx_for(variant, arch)
    assert f".entry {variant.entry}" in ptx
    assert re.search(rf"^\.target\s+{arch}\b", ptx, re.MULTILINE), f"PTX is not for {arch}"
    kind = PTX_TYPE[variant.out_dtype]
    mma = rf"\bmma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{kind}\.{kind}\.f32\b"
    assert re.search(mma, ptx), f"no {kind} m16n8k16 mma in {variant.name}"
    other = PTX_TYPE["float16" if variant.out_dtype == "bfloat16" else "bfloat16"]
    assert not re.search(rf"\bmma\.\S*\.{other}\.", ptx), f"{variant.name} multiplies {other} operands"


@needs_cupy
@needs_ptxas
@pytest.mark.parametrize("arch", MMA16_ARCHS)
@pytest.mark.parametrize("variant", MMA16_VARIANTS, ids=_ids(MMA16_VARIANTS))
def test_mma16_ptxas_no_spills(variant: KernelVariant, arch: str, tmp_path: Path) -> None:
    resources = parse_resources(ptxas_report(ptx_for(variant, arch), arch, tmp_path))
    print(f"{variant.name} {arch}: {resources}")
    assert resources["registers"] * variant.threads <= 65536, f"one block does not fit the register file: {resources}"
    assert not spills(resources), f"{variant.name} on {arch} spills or uses a stack frame: {spills(resources)}"


@needs_cupy
@pytest.mark.parametrize("variant", WGMMA_VARIANTS, ids=_ids(WGMMA_VARIANTS))
def test_wgmma_ptx(variant: KernelVariant) -> None:
    assert variant.arch == WGMMA_ARCH
    ptx = ptx_for(variant, WGMMA_ARCH)
    assert f".entry {variant.entry}" in ptx
    assert re.search(rf"^\.target\s+{WGMMA_ARCH}\b", ptx, re.MULTILINE), f"PTX is not for {WGMMA_ARCH}"
    kind = PTX_TYPE[variant.out_dtype]
    wgmma = rf"\bwgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{kind}\.{kind}\b"
    assert re.search(wgmma, ptx), f"no {kind} wgmma.mma_async in {variant.name}"


@needs_cupy
@needs_ptxas
@pytest.mark.parametrize("variant", WGMMA_VARIANTS, ids=_ids(WGMMA_VARIANTS))
def test_wgmma_ptxas_no_spills(variant: KernelVariant, tmp_path: Path) -> None:
    report = ptxas_report(ptx_for(variant, WGMMA_ARCH), WGMMA_ARCH, tmp_path)
    resources = parse_resources(report)
    print(f"{variant.name} {WGMMA_ARCH}: {resources}")
    assert not spills(resources), f"{variant.name} spills or uses a stack frame: {spills(resources)}"
    # setmaxnreg hands the producer's registers to the consumers (24 x 128 + 240 x 256): the
    # registers the block starts with must cover that, or setmaxnreg.inc waits forever.
    assert resources["registers"] * variant.threads >= 24 * 128 + 240 * 256, resources
    for warning in ("C7508", "C7510"):  # setmaxnreg ignored / wgmma serialised
        assert warning not in report, f"{variant.name}: ptxas warning {warning}:\n{report}"


@needs_cupy
@pytest.mark.parametrize("variant", WGMMA_VARIANTS, ids=_ids(WGMMA_VARIANTS))
def test_wgmma_cubin(variant: KernelVariant, tmp_path: Path) -> None:
    from pictor_diffusers.nvrtc import compile_cubin

    cubin = compile_cubin(variant, WGMMA_ARCH)
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF", "compile_cubin did not return an ELF cubin"
    assert len(cubin) >= elf_extent(cubin), f"cubin truncated: {len(cubin)} bytes, its headers need {elf_extent(cubin)}"
    assert variant.entry.encode() in cubin, f"entry {variant.entry} is not in the cubin's symbols"
    tool = sass_tool()
    if tool is None:
        pytest.skip("no cuobjdump or nvdisasm on PATH or beside ptxas: SASS not checked")
    path = tmp_path / f"{variant.name}.cubin"
    path.write_bytes(cubin)
    sass = _run([*tool, str(path)])
    assert "HGMMA" in sass, f"{variant.name}: no HGMMA in the SASS ({Path(tool[0]).name})"
    if Path(tool[0]).name == "cuobjdump":
        usage = _run([tool[0], "-res-usage", str(path)])
        local = re.search(r"LOCAL:(\d+)", usage)
        assert local is not None, f"no LOCAL in cuobjdump -res-usage:\n{usage}"
        assert int(local.group(1)) == 0, f"{variant.name} uses local memory (spills):\n{usage}"


def elf_extent(elf: bytes) -> int:
    """Bytes an ELF64 file needs to hold its section and program header tables."""
    phoff, shoff = struct.unpack_from("<QQ", elf, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 54)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"
    return result.stdout


@needs_cupy
def test_16bit_variants_differ() -> None:
    """The -D options reach NVRTC: every variant compiles to different code."""
    ptxs = {v.name: ptx_for(v, "sm_90") for v in MMA16_VARIANTS}
    ptxs |= {v.name: ptx_for(v, WGMMA_ARCH) for v in WGMMA_VARIANTS}
    assert len(set(ptxs.values())) == len(ptxs), "two variants compiled to identical PTX"


# (variant family, macro prefix) -> host value per kernel macro, checked by static_assert.
def _host_constants(variant: KernelVariant) -> dict[str, int]:
    if variant.source == "flash_attn_mma16.cu":
        return {
            "MH_THREADS": variant.threads,
            "MH_BQ": variant.rows_per_block,
            "MH_BK": kernel_sources.MMA16_TILE_KEYS,
            "MH_SMEM_BYTES": variant.shared_bytes(variant.max_head_dim),
        }
    return {
        "WG_THREADS": variant.threads,
        "WG_BQ": variant.rows_per_block,
        "WG_SMEM_BYTES": variant.shared_bytes(variant.max_head_dim),
    }


@needs_cupy
@pytest.mark.parametrize("variant", MMA16_VARIANTS + WGMMA_VARIANTS, ids=_ids(MMA16_VARIANTS + WGMMA_VARIANTS))
def test_host_constants_match_kernel(variant: KernelVariant, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch geometry `cuda_launch` uses is the one the kernel was written for."""
    from pictor_diffusers import nvrtc

    source = kernel_sources.read_source(variant)
    checks = "".join(
        f'\nstatic_assert(({macro}) == {value}, "{macro} != host value {value}");'
        for macro, value in _host_constants(variant).items()
    )
    monkeypatch.setattr(nvrtc, "read_source", lambda _: source + checks + "\n")
    arch = variant.arch or "sm_80"
    try:
        nvrtc.compile_ptx(variant, arch)
        log = ""
    except RuntimeError as error:
        log = str(error)
    found = list(dict.fromkeys(re.findall(r'"(\w+ != host value \d+)"', log)))
    assert not log, f"{variant.name}: kernel and host disagree: {found or log}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_variant_lookup(dtype: str) -> None:
    for head_dim in kernel_sources.MMA16_HEAD_DIMS:
        variant = mma16_variant_for(head_dim, dtype)
        assert variant in MMA16_VARIANTS and variant.max_head_dim == head_dim and variant.out_dtype == dtype
    for head_dim in kernel_sources.WGMMA_HEAD_DIMS:
        variant = wgmma_variant_for(head_dim, dtype)
        assert variant in WGMMA_VARIANTS and variant.max_head_dim == head_dim and variant.out_dtype == dtype
    assert kernel_sources.MMA16_HEAD_DIMS == (64, 128)
    assert 128 in kernel_sources.WGMMA_HEAD_DIMS


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_variant_lookup_refuses_other_head_dims(head_dim: int) -> None:
    with pytest.raises(ValueError, match=rf"mma16 kernel needs head_dim in .*, got {head_dim}$"):
        mma16_variant_for(head_dim, "bfloat16")
    with pytest.raises(ValueError, match=rf"wgmma kernel needs head_dim in .*, got {head_dim}$"):
        wgmma_variant_for(head_dim, "float16")


def test_sources_hold_the_entries() -> None:
    for variant in MMA16_VARIANTS + WGMMA_VARIANTS:
        source = kernel_sources.read_source(variant)
        assert re.search(rf'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?{variant.entry}\(', source)


@needs_cupy
def test_cubin_cache_recompiles_a_corrupt_file_and_survives_a_read_only_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pictor_diffusers import nvrtc

    variant = WGMMA_VARIANTS[0]
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    first = nvrtc.cached_cubin(variant, WGMMA_ARCH)
    assert first.parent == tmp_path / "cache" and first.stat().st_mode & 0o044 == 0o044
    first.write_bytes(b"half-written")
    again = nvrtc.cached_cubin(variant, WGMMA_ARCH)
    assert again == first and again.read_bytes()[:4] == b"\x7fELF", "a corrupt cache entry was not rebuilt"
    assert not list(first.parent.glob("*.tmp")), "temporary files left behind"

    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    monkeypatch.setenv(nvrtc.CACHE_ENV, str(read_only / "cache"))
    if os.access(read_only, os.W_OK):
        pytest.skip("running as a user who can write anywhere (root): read-only case not testable")
    fallback = nvrtc.cached_cubin(variant, WGMMA_ARCH)
    assert fallback.parent.parent == tmp_path / "tmp" and fallback.read_bytes()[:4] == b"\x7fELF"
