"""NVRTC compilation without a GPU: PTX for inspection, cubins for sm_90a.

* `compile_ptx`: used by the compile tests (every variant, on a CPU-only
  machine). Most launches go through `cuda_launch`, where CuPy compiles for
  the device at hand.
* `compile_cubin` / `cached_cubin`: kernels that need an arch-specific target
  (wgmma and setmaxnreg need sm_90a, which `cupy.RawModule(code=...)` cannot
  ask for) are compiled here to a cubin and cached on disk, keyed by source,
  options and NVRTC version; CuPy then loads the file.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from .kernel_sources import KernelVariant, read_source

CACHE_ENV = "PICTOR_CACHE_DIR"


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


def _compile(variant: KernelVariant, target: str, cubin: bool) -> bytes:
    load_nvrtc_library()
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(read_source(variant), variant.source, [], [])
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


def compile_ptx(variant: KernelVariant, arch: str) -> str:
    """Compile `variant` to PTX for `arch` (e.g. "sm_90", "sm_90a"); raises with the NVRTC log."""
    return _compile(variant, f"compute_{arch.removeprefix('sm_')}", cubin=False).decode().rstrip("\0")


def compile_cubin(variant: KernelVariant, arch: str) -> bytes:
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


def cache_dir() -> Path:
    """Where cubins are cached: $PICTOR_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, /pictor-diffusers."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pictor-diffusers"


def _cache_dirs() -> tuple[Path, Path]:
    """The cache, then a per-user temporary folder for machines whose cache is read-only."""
    user = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return cache_dir(), Path(tempfile.gettempdir()) / f"pictor-diffusers-{user}"


def _is_cubin(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(5) == b"\x7fELF\x02"
    except OSError:
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and a rename, readable by others, never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False)
    try:
        with handle:
            handle.write(data)
        os.chmod(handle.name, 0o644)
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def cached_cubin(variant: KernelVariant, arch: str) -> Path:
    """Path of `variant`'s cubin for `arch`, compiled on a cache miss.

    The file name hashes the source text, the options, the arch and the NVRTC
    version, so an edited kernel or a new toolkit never reuses a stale binary.
    Writes are atomic, safe across processes; a cache folder that cannot be
    written falls back to a per-user temporary folder.
    """
    key = "\0".join((read_source(variant), *variant.options(), arch, repr(nvrtc_version())))
    name = f"{variant.name}-{arch}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.cubin"
    folders = _cache_dirs()
    for folder in folders:
        if _is_cubin(folder / name):
            return folder / name
    cubin = compile_cubin(variant, arch)
    errors = []
    for folder in folders:
        try:
            _write_atomic(folder / name, cubin)
            return folder / name
        except OSError as error:
            errors.append(f"{folder}: {error}")
    raise RuntimeError(f"cannot cache the {variant.name} cubin ({'; '.join(errors)}); set {CACHE_ENV}")
