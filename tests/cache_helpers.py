"""Shared helpers of the binary-cache tests: entries as stored, planting, a counting build."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from pictor_diffusers.cuda.cubin_cache import CACHE_ENV, TRAILER

BUILT = b"\x7fELF\x02 built"
PLANTED = b"\x7fELF\x02 planted"
OTHER_UID = 54321
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
needs_non_root = pytest.mark.skipif(IS_ROOT, reason="root writes through permission bits")


def is_valid(data: bytes) -> bool:
    return data.startswith(b"\x7fELF")


def stored(content: bytes) -> bytes:
    """What the cache writes for `content`: the content, then its SHA-256 trailer."""
    return content + TRAILER + hashlib.sha256(content).digest()


class Build:
    """A `build` callable that counts its calls."""

    def __init__(self, data: bytes = BUILT) -> None:
        self.data, self.calls = data, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


def entry(folder: Path, name: str = "kernel", key: str = "key") -> Path:
    return folder / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.cubin"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def plant(path: Path, data: bytes = stored(PLANTED), folder_mode: int = 0o700, file_mode: int = 0o600) -> Path:
    """Create `path` with `data` inside a folder of mode `folder_mode`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, file_mode)
    os.chmod(path.parent, folder_mode)
    return path


def use_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    """Point the user's cache and the temporary fallback under `tmp_path`; return both (not yet created)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "home" / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    return tmp_path / "home" / "cache", tmp_path / "tmp" / f"pictor-diffusers-{os.getuid()}"
