"""NVRTC compilation, with or without a GPU (PTX for inspection, cubins to run), and the loaded kernels.

* `compile_ptx`: the compile tests inspect every variant on a CPU-only machine.
* `cached_module`: the bytes of the cubin a device loads, for its exact arch
  (`sm_90a` for wgmma), cached on disk by `cubin_cache`, keyed by the source,
  the shared header, the options, the arch and the NVRTC version, and checked
  (SHA-256, ELF structure) before they are handed out.
* `function`: a variant's `CUfunction` handle on a device (`device_facts` gives its arch), loaded once per
  process and device from those checked bytes in memory. The cache is bounded by the registry's finite
  variant set.

The shared headers (`sources.HEADERS`, roles in `kernels/common.cuh`) reach NVRTC in memory, so no include
path is needed.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from . import runtime
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
    restored = cubin + b"\0" * missing if missing in (0, 1) else cubin
    problem = elf_problem(restored)
    if problem is not None:
        raise RuntimeError(f"NVRTC returned a cubin that is not a complete 64-bit ELF: {problem}")
    return restored


def elf_problem(data: bytes) -> str | None:
    """Why `data` is not a complete little-endian 64-bit ELF (a cubin), or None: the header, the program-
    and section-header tables and every section with file content must lie inside the bytes."""

    def field(at: int, width: int) -> int:
        return int.from_bytes(data[at : at + width], "little")

    if len(data) < 64 or data[:6] != b"\x7fELF\x02\x01":
        return f"{len(data)} bytes that do not start with a little-endian 64-bit ELF header"
    tables = ((field(0x20, 8), field(0x36, 2), field(0x38, 2)), (field(0x28, 8), field(0x3A, 2), field(0x3C, 2)))
    for offset, entry_size, count in tables:
        if offset + entry_size * count > len(data):
            return f"a header table ends at byte {offset + entry_size * count}, past the file's {len(data)}"
    section_table, entry_size, count = tables[1]
    for index in range(count):
        at = section_table + index * entry_size
        nobits = field(at + 4, 4) == 8
        end = field(at + 0x18, 8) + field(at + 0x20, 8)
        if not nobits and end > len(data):
            return f"section {index} ends at byte {end}, past the file's {len(data)}"
    return None


def _cache_key(variant: Variant, target: str) -> str:
    """Source, shared header, options, target and NVRTC version: an edited kernel or a new
    toolkit never reuses a stale binary."""
    parts = (read_source(variant.spec.source), *header_texts(), *variant.options(), target, repr(nvrtc_version()))
    return "\0".join(parts)


def cached_cubin(variant: Variant, arch: str, rebuild: bool = False) -> bytes:
    """`variant`'s cubin for exactly `arch` (e.g. "sm_90a"): the checked bytes of the on-disk cache,
    compiled on a miss (`rebuild`: compiled and replaced whatever the cache holds)."""
    key = _cache_key(variant, arch)
    return cached_binary(
        f"{variant.name}-{arch}",
        key,
        lambda: compile_cubin(variant, arch),
        lambda data: elf_problem(data) is None,
        rebuild,
    )


def cached_module(variant: Variant, capability: tuple[int, int], rebuild: bool = False) -> bytes:
    """The cubin a device of `capability` loads: for its exact arch, or `sm_90a` for arch-specific rows.

    This is what CuPy did for these kernels before the registry (an NVRTC cubin for the device's
    arch), with the same flags (the row's `flags`), so the machine code is the same.
    """
    return cached_cubin(variant, variant.arch(capability), rebuild)


@functools.cache
def device_facts(device_index: int) -> tuple[tuple[int, int], int]:
    """(compute capability, opt-in shared memory bytes per block) of a device."""
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.shared_memory_per_block_optin


@functools.cache
def multiprocessors(device_index: int) -> int:
    """The device's SM count (a persistent kernel's grid)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_functions: dict[tuple[str, int], tuple[Any, int]] = {}
_lock = threading.Lock()


def function(variant: Variant, device_index: int) -> int:
    """The `CUfunction` handle of `variant` on the device, compiled and loaded on first use."""
    entry = _functions.get((variant.name, device_index))
    if entry is None:
        with _lock:
            entry = _functions.get((variant.name, device_index))
            if entry is None:
                entry = _functions[(variant.name, device_index)] = _load(variant, device_index)
    return entry[1]


def _load(variant: Variant, device_index: int) -> tuple[Any, int]:
    """(the loaded module, keeping it alive; the `CUfunction` handle) of `variant` on the device.

    The module is loaded from the exact bytes the cache checked (`cuModuleLoadData`), never re-opened
    by path; a binary the driver refuses is rebuilt once and replaced in the cache.
    """
    cupy = runtime.import_cupy()
    load_nvrtc_library()
    capability, _ = device_facts(device_index)
    with cupy.cuda.Device(device_index):
        try:
            module = _module(cupy, cached_module(variant, capability))
        except cupy.cuda.driver.CUDADriverError:
            module = _module(cupy, cached_module(variant, capability, rebuild=True))
        handle = module.get_function(variant.spec.entry).ptr
        shared = variant.shared_bytes
        if shared > 48 * 1024:
            driver = cupy.cuda.driver
            driver.funcSetAttribute(handle, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared)
    return module, handle


def _module(cupy: Any, cubin: bytes) -> Any:
    """A CuPy `Module` loaded from `cubin`'s bytes in memory."""
    module = cupy.cuda.function.Module()
    module.load(cubin)
    return module
