"""Every kernel of the registry compiles on a machine without a GPU, as the host builds it.

* NVRTC (through CuPy's bindings, no driver needed) compiles each variant to
  PTX for its archs: the entry point is there, and the instructions its
  family promises (f32 FMA and no tensor cores for the scalar reference; TF32
  mma for 3xTF32; 16-bit mma.sync or wgmma of the variant's dtype).
* The geometry comes from the registry as `-D`: dropping any define fails
  the compile by `#error`, and a wrong value fails a kernel `static_assert`.
* One block fits the register file, and no variant that runs FLUX.2 spills:
  by ptxas where it is on PATH and takes NVRTC's PTX, else from NVRTC's own
  cubin by cuobjdump.
* The wgmma cubins are complete ELFs whose SASS holds HGMMA (IGMMA and QGMMA for fp8), and no local memory
  or device globals (a `static constexpr` member, for one, would be emitted as a global).
* Every `#include` of a source or header names one of `sources.HEADERS`, which NVRTC gets in memory.

Tests skip with the reason when CuPy (NVRTC) or the tools a check needs are absent.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from compile_tools import cubin_resources, needs_cupy, parse_resources, ptx_for, ptxas_report, sass_tool, spills

from pictor_diffusers.cuda.pass_rows import (
    PROLOGUE,
    PROLOGUE_SPLIT,
    QUANTIZE,
    QUANTIZE_U8,
    SPLIT,
    prologue_split_variant,
    prologue_variant,
    quantize_variant,
    split_variant,
)
from pictor_diffusers.cuda.registry import BY_NAME, KERNELS, Variant, variants

PTX_TYPE = {"bfloat16": "bf16", "float16": "f16"}
PROLOGUES = tuple(
    prologue_variant(d, dtype, out)
    for d in (32, 128)
    for dtype in PTX_TYPE | {"float32": ""}
    for out in {"float32", dtype}
)
SPLIT_PROLOGUES = tuple(prologue_split_variant(128, dtype) for dtype in ("float32", *PTX_TYPE))
PREPASSES = (split_variant(128), *(quantize_variant(128, d, pv) for d in PTX_TYPE for pv in ("0", "1")))
ALL = tuple(v for spec in KERNELS for v in variants(spec)) + PROLOGUES + SPLIT_PROLOGUES + PREPASSES
PASSES = (PROLOGUE, PROLOGUE_SPLIT, SPLIT, QUANTIZE, QUANTIZE_U8)
"""The rows that are not attention kernels: the prologues and the prepasses."""
MAY_SPILL = {"f32_d256_float32_to_float32", "f32_d384_float32_to_float32"}
"""Wide scalar-kernel builds (head_dim > 128: no FLUX.2 model) may spill; they warn instead."""


def archs(variant: Variant) -> list[str]:
    """The targets a variant is checked on: its arch-specific one, else sm_80 and sm_90 where it runs."""
    if variant.spec.arch_suffix:
        return [variant.arch((9, 0))]
    return [f"sm_{a}{b}" for a, b in ((8, 0), (9, 0)) if (a, b) >= variant.spec.min_capability]


BUILDS = [(v, arch) for v in ALL for arch in archs(v)]
BUILD_IDS = [f"{v.name}-{arch}" for v, arch in BUILDS]


def _family_instructions(variant: Variant, ptx: str) -> None:
    name = variant.spec.name
    if name == "f32":
        tensor_core = sorted(set(re.findall(r"\b(?:wgmma|wmma|mma)\.[\w.]+", ptx)))
        assert not tensor_core, f"tensor-core instructions in the parity reference: {tensor_core[:5]}"
        assert not re.search(r"\S*\.b?f16\S*", ptx), "16-bit staging in the parity reference"
        assert re.search(r"\bfma\.rn(?:\.ftz)?\.f32\b", ptx), "no f32 FMA in the PTX"
    elif name == "fp16x3":
        for shape in ("m64n64k16", "m64n128k16"):
            assert re.search(rf"\bwgmma\.mma_async\.sync\.aligned\.{shape}\.f32\.f16\.f16\b", ptx), f"no f16 {shape}"
        assert not re.search(r"\b(?:w?g?mma)\S*\.bf16\b", ptx), "bf16 products in the fp16x3 kernel"
    elif name == "tf32x3":
        assert re.search(r"\bmma\.sync\.aligned\.m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32\b", ptx), "no TF32 mma"
    elif name in ("mma16", "wgmma"):
        kind = PTX_TYPE[variant.in_dtype]
        other = PTX_TYPE["float16" if variant.in_dtype == "bfloat16" else "bfloat16"]
        mma = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32" if name == "mma16" else r"wgmma\.mma_async\.\S*f32"
        assert re.search(rf"\b{mma}\.{kind}\.{kind}\b", ptx), f"no {kind} tensor-core product in {variant.name}"
        assert not re.search(rf"\b(?:w?g?mma)\S*\.{other}\.{other}\b", ptx), f"{variant.name} multiplies {other}"
    elif name in ("fp8", "int8"):
        products = ".f32.e4m3.e4m3" if name == "fp8" else ".s32.u8.s8"
        assert re.search(r"\bwgmma\.mma_async\.sync\.aligned\.m64n128k32\.s32\.s8\.s8\b", ptx), "no int8 Q.K wgmma"
        for shape in ("m64n128k32", "m64n8k32"):
            assert f"wgmma.mma_async.sync.aligned.{shape}{products} " in ptx, f"no {shape}{products} P.V"
        if name == "fp8":
            conversions = len(re.findall(r"\bcvt\.rn\.f32\.s32\b", ptx))  # the epilogue's log2f: one per row
            assert conversions <= 4, f"{conversions} s32 -> f32 I2F conversions: the scores' bias trick is gone"
        else:
            assert "cvt.pack.sat.u8.s32.b32" in ptx, "P's u8 codes are not packed by cvt.pack (F2IP)"
    elif name == "quantize8":
        assert re.search(r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b", ptx), "no E4M3 conversion in the prepass"
    elif name == "quantize8_u8":
        assert "e4m3" not in ptx, "E4M3 codes in the int8 kernel's prepass"


@needs_cupy
@pytest.mark.parametrize(("variant", "arch"), BUILDS, ids=BUILD_IDS)
def test_compiles_with_its_family_instructions(variant: Variant, arch: str) -> None:
    ptx = ptx_for(variant, arch)
    assert f".entry {variant.spec.entry}" in ptx
    target = arch.removesuffix("a")
    assert re.search(rf"^\.target\s+{target}a?\b", ptx, re.MULTILINE), f"PTX is not for {arch}"
    _family_instructions(variant, ptx)


def _setmaxnreg_counts(ptx: str) -> tuple[int, int] | None:
    """A warp-specialised kernel's setmaxnreg counts, (producer's decrease, consumers' increase); None without."""
    counts = {kind: set(re.findall(rf"setmaxnreg\.{kind}\.sync\.aligned\.u32\s+(\d+)", ptx)) for kind in ("dec", "inc")}
    if not any(counts.values()):
        return None
    (producer,), (consumer,) = counts["dec"], counts["inc"]
    return int(producer), int(consumer)


@needs_cupy
@pytest.mark.parametrize(("variant", "arch"), BUILDS, ids=BUILD_IDS)
def test_fits_the_register_file_without_spills(variant: Variant, arch: str, tmp_path: Path) -> None:
    report = ptxas_report(ptx_for(variant, arch), arch, tmp_path) if shutil.which("ptxas") else None
    resources = parse_resources(report) if report else cubin_resources(variant, arch, tmp_path)
    print(f"{variant.name} {arch}: {resources}")
    assert resources["registers"] * variant.threads <= 65536, f"one block does not fit: {resources}"
    handover = _setmaxnreg_counts(ptx_for(variant, arch))
    if handover is not None:
        producer, consumer = handover
        needed = 128 * producer + (variant.threads - 128) * consumer
        assert needed <= resources["registers"] * variant.threads, (
            f"{variant.name}: the block starts with {resources['registers']} x {variant.threads} registers, its "
            f"setmaxnreg hand-over needs {needed}: the consumers' increase would wait forever"
        )
    if variant.name in MAY_SPILL:
        return
    assert not spills(resources), f"{variant.name} on {arch} spills or uses a stack frame: {resources}"


HOPPER_BUILDS = [(v, arch) for v, arch in BUILDS if arch.endswith("a")]


@needs_cupy
@pytest.mark.parametrize(("variant", "arch"), BUILDS, ids=BUILD_IDS)
def test_compiled_for_the_block_the_host_launches(variant: Variant, arch: str) -> None:
    """A kernel bounded by `__launch_bounds__` is bounded by the host's block (`Variant.threads`); the
    warp-specialised ones hand registers over by setmaxnreg within the 64K register file: the producer warpgroup's
    and the consumer warpgroups' counts, multiples of 8 in [24, 256]."""
    ptx = ptx_for(variant, arch)
    bound = re.search(r"^\s*\.maxntid\s+(\d+)", ptx, re.MULTILINE)
    if bound is not None:
        assert int(bound.group(1)) == variant.threads, f"{variant.name}: .maxntid {bound.group(1)}"
    handover = _setmaxnreg_counts(ptx)
    if handover is None:
        return
    producer, consumer = handover
    counts = {"dec": producer, "inc": consumer}
    assert all(24 <= n <= 256 and n % 8 == 0 for n in (producer, consumer)), counts
    assert 128 * producer + (variant.threads - 128) * consumer <= 65536, f"{variant.name}: {counts}"


@needs_cupy
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (the CUDA toolkit) for its wgmma report")
@pytest.mark.parametrize(("variant", "arch"), HOPPER_BUILDS, ids=[f"{v.name}-{a}" for v, a in HOPPER_BUILDS])
def test_wgmma_products_stay_asynchronous(variant: Variant, arch: str, tmp_path: Path) -> None:
    """ptxas serialises every wgmma of a kernel (info C7514 and its kin) when other code touches an accumulator
    between a product's issue and its wait; the kernel then runs, correct and far slower. No build may."""
    report = ptxas_report(ptx_for(variant, arch), arch, tmp_path)
    if report is None:
        pytest.skip("this ptxas is older than the PTX")
    serialised = [line for line in report.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serialised, f"{variant.name}: {serialised[0]}"


@needs_cupy
def test_defines_reach_nvrtc() -> None:
    """Every variant of a source compiles to different code: its -D options are used."""
    for spec in (*KERNELS, *PASSES):
        builds = [(v, arch) for v, arch in BUILDS if v.spec is spec and arch == archs(v)[-1]]
        ptxs = {v.name: ptx_for(v, arch) for v, arch in builds}
        assert builds, f"no {spec.name} build"
        assert len(set(ptxs.values())) == len(ptxs), f"two {spec.name} variants compiled to identical PTX"


def _compile_log(variant: Variant, options: tuple[str, ...]) -> str:
    """NVRTC's error log for `variant` built with `options` instead of its own ('' if it compiles)."""
    from pictor_diffusers.cuda import nvrtc

    class Edited(Variant):
        def options(self) -> tuple[str, ...]:
            return options

    edited = Edited(variant.spec, variant.head_dim, variant.in_dtype, variant.out_dtype)
    try:
        nvrtc.compile_ptx(edited, archs(variant)[-1])
    except RuntimeError as error:
        return str(error)
    return ""


FIRST_OF_EACH = [variants(spec)[-1] for spec in KERNELS] + [PROLOGUES[-1], SPLIT_PROLOGUES[-1], *PREPASSES]


@needs_cupy
@pytest.mark.parametrize("variant", FIRST_OF_EACH, ids=[v.spec.name for v in FIRST_OF_EACH])
def test_every_define_is_required(variant: Variant) -> None:
    """Geometry has one source, the registry: a kernel never falls back to a default of its own."""
    for dropped in (option for option in variant.options() if option.startswith("-D")):
        macro = dropped.removeprefix("-D").split("=")[0]
        log = _compile_log(variant, tuple(o for o in variant.options() if o != dropped))
        assert log, f"{variant.spec.source} compiled without {macro}"
        assert macro in log, f"dropping {macro} failed without naming it:\n{log[-800:]}"


WGMMA_D64 = next(v for v in variants(BY_NAME["wgmma"]) if v.head_dim == 64)
"""The wgmma row's head_dim-64 build: three consumer warpgroups, a geometry of its own."""


@needs_cupy
@pytest.mark.parametrize("variant", [*FIRST_OF_EACH, WGMMA_D64], ids=[v.name for v in [*FIRST_OF_EACH, WGMMA_D64]])
def test_wrong_geometry_fails_a_static_assert(variant: Variant) -> None:
    """A host value that disagrees with the kernel's own formulas does not compile."""
    for key in ("THREADS", "SMEM_BYTES"):
        macro = variant.spec.prefix + key
        options = variant.options()
        if not any(o.startswith(f"-D{macro}=") for o in options):
            continue
        edited = tuple(
            f"-D{macro}={int(o.split('=')[1].rstrip('u')) + 32}" if o.startswith(f"-D{macro}=") else o for o in options
        )
        assert _compile_log(variant, edited), f"{variant.spec.source} accepted a wrong {macro}"


def elf_extent(elf: bytes) -> int:
    """Bytes an ELF64 file needs to hold its section and program header tables."""
    phoff, shoff = struct.unpack_from("<QQ", elf, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 54)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"
    return result.stdout


WGMMA = tuple(v for name in ("wgmma", "fp16x3", "fp8", "int8") for v in variants(BY_NAME[name]))


@needs_cupy
@pytest.mark.parametrize("variant", WGMMA, ids=[v.name for v in WGMMA])
def test_wgmma_cubin(variant: Variant, tmp_path: Path) -> None:
    from pictor_diffusers.cuda.nvrtc import compile_cubin

    cubin = compile_cubin(variant, variant.arch((9, 0)))
    assert cubin[:4] == b"\x7fELF", "compile_cubin did not return an ELF cubin"
    assert len(cubin) >= elf_extent(cubin), f"cubin truncated: {len(cubin)} bytes, its headers need {elf_extent(cubin)}"
    assert variant.spec.entry.encode() in cubin
    tool = sass_tool()
    if tool is None:
        pytest.skip("no cuobjdump or nvdisasm on PATH, beside ptxas or from pip: SASS not checked")
    path = tmp_path / f"{variant.name}.cubin"
    path.write_bytes(cubin)
    sass = _run([*tool, str(path)])
    expected = {"fp8": ("IGMMA", "QGMMA"), "int8": ("IGMMA",)}.get(variant.spec.name, ("HGMMA",))
    for instruction in expected:
        assert instruction in sass, f"{variant.name}: no {instruction} in the SASS"
    if Path(tool[0]).name == "cuobjdump":
        usage = _run([tool[0], "-res-usage", str(path)])
        local, globals_ = re.search(r"LOCAL:(\d+)", usage), re.search(r"GLOBAL:(\d+)", usage)
        assert local is not None and int(local.group(1)) == 0, f"{variant.name} uses local memory"
        assert globals_ is not None and int(globals_.group(1)) == 0, f"{variant.name} defines device globals"


@needs_cupy
def test_cached_cubin_is_keyed_and_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pictor_diffusers.cuda import cubin_cache, nvrtc

    monkeypatch.setenv(cubin_cache.CACHE_ENV, str(tmp_path / "cache"))
    variant = variants(BY_NAME["mma16"])[0]
    first = nvrtc.cached_cubin(variant, "sm_80")
    assert nvrtc.elf_problem(first) is None
    (path,) = (tmp_path / "cache").iterdir()
    assert path.read_bytes().startswith(first), "the cache does not hold the cubin it handed out"
    assert nvrtc.cached_cubin(variant, "sm_90") != first, "the arch is not part of the key"
    for cut in (len(first) // 2, len(first)):  # truncated inside the ELF, then only the trailer lost
        path.write_bytes(first[:cut])
        assert cut == len(first) or nvrtc.elf_problem(first[:cut]) is not None, "a cut cubin passed the ELF check"
        assert nvrtc.cached_cubin(variant, "sm_80") == first, f"a cubin cut at byte {cut} was not rebuilt"
        assert path.read_bytes().startswith(first)


def test_sources_hold_the_entries() -> None:
    from pictor_diffusers.cuda.sources import read_source

    for spec in (*KERNELS, *PASSES):
        source = read_source(spec.source)
        assert re.search(rf'extern "C" __global__ void (?:__launch_bounds__\([^)]*\)\s+)?{spec.entry}\(', source)


def _includes(text: str) -> list[str]:
    return re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)


def test_headers_are_the_ones_nvrtc_gets() -> None:
    """Every `#include "..."` of a source or header is one of `HEADERS` (what NVRTC gets in memory), every header
    is included by some source, and each guards itself."""
    from pictor_diffusers.cuda.sources import HEADERS, kernels_dir, read_source

    on_disk = sorted(path.name for path in kernels_dir().glob("*.cuh"))
    assert sorted(HEADERS) == on_disk, "HEADERS and the .cuh files of kernels/ differ"
    sources = [spec.source for spec in (*KERNELS, *PASSES)]
    reached: set[str] = set()
    for name in (*sources, *HEADERS):
        for header in _includes(read_source(name)):
            assert header in HEADERS, f"{name} includes {header}, which NVRTC does not get"
            reached.add(header)
    assert reached == set(HEADERS), f"headers no source includes: {sorted(set(HEADERS) - reached)}"
    for header in HEADERS:
        guard = re.search(r"^#ifndef (PICTOR_\w+_CUH)\n#define \1$", read_source(header), re.MULTILINE)
        assert guard, f"{header} has no include guard"
