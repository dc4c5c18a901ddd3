"""Ahead-of-launch NVRTC compilation to PTX; needs no GPU and no driver.

Used by the compile tests (every variant, sm_80 and sm_90, on a CPU-only
machine) and by anyone who wants to inspect the generated code. Launches go
through `cuda_launch`, which lets CuPy compile for the device at hand.
"""

from __future__ import annotations

from .kernel_sources import KernelVariant, read_source


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


def compile_ptx(variant: KernelVariant, arch: str) -> str:
    """Compile `variant` to PTX for `arch` (e.g. "sm_90"); raises with the NVRTC log."""
    load_nvrtc_library()
    from cupy_backends.cuda.libs import nvrtc

    source = read_source(variant)
    program = nvrtc.createProgram(source, variant.source, [], [])
    options = [f"--gpu-architecture=compute_{arch.removeprefix('sm_')}", *variant.options()]
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC failed on {variant.name} for {arch}:\n{log}") from error
        ptx = nvrtc.getPTX(program)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(program)
