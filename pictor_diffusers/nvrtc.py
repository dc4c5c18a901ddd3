"""NVRTC compilation, with or without a GPU: PTX for inspection, cubins to run.

* `compile_ptx`: the compile tests inspect every variant on a CPU-only machine.
* `cached_module`: the cubin a device loads, for its exact arch (`sm_90a` for
  wgmma), cached on disk by `cubin_cache`, keyed by the source, the shared
  header, the options, the arch and the NVRTC version.

The shared header `kernels/common.cuh` reaches NVRTC in memory, so no include
path is needed.
"""

from __future__ import annotations

from pathlib import Path

from .cubin_cache import cached_binary
from .registry import Variant
from .sources import HEADERS, header_texts, read_source


def load_nvrtc_library() -> None:
    """Make libnvrtc loadable for CuPy, from the CUDA install or a pip wheel.

    CuPy looks for libnvrtc by its CUDA major version; with no driver present it
    can miss the `nvidia-cuda-nvrtc-cu12` wheel. Loading the library through
    cuda-pathfinder first (a CuPy dependency) makes the later lookup succeed.
    """
    try:
        from cuda import pathfinder
    except ImportError:
        return
    try:
        pathfinder.load_nvidia_dynamic_lib("nvrtc")
    except Exception:
        return


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC that CuPy loads."""
    load_nvrtc_library()
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def _compile(variant: Variant, target: str, cubin: bool) -> bytes:
    load_nvrtc_library()
    from cupy_backends.cuda.libs import nvrtc

    source = variant.spec.source
    headers = [text.encode() for text in header_texts()]
    program = nvrtc.createProgram(read_source(source), source, headers, [name.encode() for name in HEADERS])
    try:
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture={target}", *variant.options()])
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed on {variant.name} for {target}:\n{log}") from error
        code = nvrtc.getCUBIN(program) if cubin else nvrtc.getPTX(program)
        return code if isinstance(code, bytes) else code.encode()
    finally:
        nvrtc.destroyProgram(program)


def compile_ptx(variant: Variant, arch: str) -> str:
    """Compile `variant` to PTX for `arch` (e.g. "sm_90", "sm_90a"); raises with the NVRTC log."""
    return _compile(variant, f"compute_{arch.removeprefix('sm_')}", cubin=False).decode().rstrip("\0")


def compile_cubin(variant: Variant, arch: str) -> bytes:
    """Compile `variant` to a cubin for exactly `arch` (e.g. "sm_90a"); raises with the NVRTC log."""
    return _restore_elf_tail(_compile(variant, arch, cubin=True))


def _restore_elf_tail(cubin: bytes) -> bytes:
    """Undo CuPy's `getCUBIN` dropping the last byte as if it were a C string's NUL.

    A cubin is a 64-bit ELF that ends with its section- or program-header
    table; the byte CuPy drops is the top byte of that table's last 8-byte
    little-endian field, which is 0; put it back.
    """

    def field(at: int, width: int) -> int:
        return int.from_bytes(cubin[at : at + width], "little")

    program_headers_end = field(0x20, 8) + field(0x36, 2) * field(0x38, 2)
    section_headers_end = field(0x28, 8) + field(0x3A, 2) * field(0x3C, 2)
    missing = max(program_headers_end, section_headers_end) - len(cubin)
    if cubin[:5] != b"\x7fELF\x02" or missing not in (0, 1):
        raise RuntimeError(f"NVRTC returned a cubin of {len(cubin)} bytes that is not a complete 64-bit ELF")
    return cubin + b"\0" * missing


def _is_cubin(data: bytes) -> bool:
    return data[:5] == b"\x7fELF\x02"


def _cache_key(variant: Variant, target: str) -> str:
    """Source, shared header, options, target and NVRTC version: an edited kernel or a new
    toolkit never reuses a stale binary."""
    parts = (read_source(variant.spec.source), *header_texts(), *variant.options(), target, repr(nvrtc_version()))
    return "\0".join(parts)


def cached_cubin(variant: Variant, arch: str) -> Path:
    """Path of `variant`'s cubin for exactly `arch` (e.g. "sm_90a"), compiled on a cache miss."""
    key = _cache_key(variant, arch)
    return cached_binary(f"{variant.name}-{arch}", key, lambda: compile_cubin(variant, arch), _is_cubin)


def cached_module(variant: Variant, capability: tuple[int, int]) -> Path:
    """The cubin a device of `capability` loads: for its exact arch, or `sm_90a` for arch-specific rows.

    This is what CuPy did for these kernels before the registry (an NVRTC cubin for the device's
    arch), with the same flags (the row's `flags`), so the machine code is the same.
    """
    return cached_cubin(variant, variant.arch(capability))
