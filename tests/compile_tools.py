"""NVRTC / ptxas / SASS helpers shared by the compile tests (no GPU needed)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pictor_diffusers.cuda.registry import Variant


def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


needs_cupy = pytest.mark.skipif(
    not _cupy_importable(), reason="NVRTC compiles through CuPy: pip install 'pictor-diffusers[cuda12]'"
)


@functools.cache
def ptx_for(variant: Variant, arch: str) -> str:
    from pictor_diffusers.cuda.nvrtc import compile_ptx

    return compile_ptx(variant, arch)


def ptxas_report(ptx: str, arch: str, tmp_path: Path) -> str | None:
    """`ptxas -v` output for `ptx` assembled for `arch`; None if ptxas is older than the PTX."""
    ptx_file, cubin = tmp_path / "kernel.ptx", tmp_path / "kernel.cubin"
    ptx_file.write_text(ptx, encoding="utf-8")
    result = subprocess.run(
        ["ptxas", f"-arch={arch}", "-v", str(ptx_file), "-o", str(cubin)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    report = result.stdout + result.stderr
    if result.returncode != 0 and "Unsupported .version" in report:
        return None
    assert result.returncode == 0, f"ptxas failed:\n{report}"
    assert cubin.stat().st_size > 0
    return report


def parse_resources(report: str) -> dict[str, int]:
    """registers, stack frame and spill bytes from `ptxas -v` output."""
    patterns = {
        "registers": r"Used (\d+) registers",
        "stack_frame": r"(\d+) bytes stack frame",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
    }
    found = {key: re.search(pattern, report) for key, pattern in patterns.items()}
    missing = [key for key, match in found.items() if match is None]
    assert not missing, f"could not parse {missing} from ptxas -v output:\n{report}"
    return {key: int(match.group(1)) for key, match in found.items() if match is not None}


def spills(resources: dict[str, int]) -> dict[str, int]:
    """The non-zero stack-frame and spill counts of `parse_resources` output."""
    return {key: resources[key] for key in ("stack_frame", "spill_stores", "spill_loads") if resources[key]}


def _nvidia_wheel_bins() -> list[str]:
    """The bin folders of NVIDIA's pip wheels (the test extra's nvidia-cuda-cuobjdump and -nvdisasm)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(str(folder) for root in nvidia.__path__ for folder in Path(root).glob("*/bin") if folder.is_dir())


def cuda_tool(name: str) -> str | None:
    """The path of a CUDA command-line tool: from PATH, beside ptxas or from NVIDIA's pip wheels."""
    places: list[str | None] = [None]
    ptxas = shutil.which("ptxas")
    if ptxas:
        places.append(str(Path(ptxas).resolve().parent))
    places += _nvidia_wheel_bins()
    return next((found for place in places if (found := shutil.which(name, path=place))), None)


def sass_tool() -> list[str] | None:
    """A command printing a cubin's SASS (`cuobjdump -sass` or `nvdisasm`), or None."""
    for name, args in (("cuobjdump", ["-sass"]), ("nvdisasm", [])):
        found = cuda_tool(name)
        if found:
            return [found, *args]
    return None


def cubin_resources(variant: Variant, arch: str, tmp_path: Path) -> dict[str, int]:
    """`parse_resources`' keys for the NVRTC cubin of `variant` on `arch`, read by `cuobjdump -res-usage`
    (for machines without ptxas; a spill shows as a stack frame, so the spill counts read 0)."""
    from pictor_diffusers.cuda.nvrtc import compile_cubin

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("neither ptxas nor cuobjdump (PATH or pip's nvidia-cuda-cuobjdump): resources not checked")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(compile_cubin(variant, arch))
    result = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True, timeout=120)
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", result.stdout)
    assert result.returncode == 0 and usage is not None, f"cuobjdump -res-usage failed:\n{result.stdout}{result.stderr}"
    registers, stack, local = (int(x) for x in usage.groups())
    return {"registers": registers, "stack_frame": max(stack, local), "spill_stores": 0, "spill_loads": 0}
