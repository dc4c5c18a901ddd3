"""The on-disk cache of compiled kernel binaries, private to the user.

* `cache_dir()`: `$PICTOR_CACHE_DIR`, else `$XDG_CACHE_HOME` or `~/.cache`, then `pictor-diffusers`.
* Every folder it creates (missing parents included) is made 0700 whatever the umask. Before a
  folder is read or written it must be a real directory (not a symbolic link), owned by the user and
  not writable by group or others; anything else raises `UnsafeCacheError` naming it.
* A cached file is loaded only if it is a regular file (not a link) with the same ownership and mode
  rules and its content passes the caller's check; otherwise it is rebuilt and atomically replaced.
* `<tempdir>/pictor-diffusers-<uid>` is a fallback, read or written only when the user's cache cannot
  be created or written (read-only filesystem, no permission, a failed write), never on a plain miss.
* Writes go to a temporary file in the same folder, then `os.replace`: concurrent processes never see
  a partial file. Nothing is kept in memory between calls.

Windows has neither `getuid` nor meaningful permission bits in `st_mode`, so there only the
link/directory/regular-file checks apply.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

CACHE_ENV = "PICTOR_CACHE_DIR"
_POSIX = hasattr(os, "getuid")
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


class UnsafeCacheError(RuntimeError):
    """A cache folder that another user could have planted or can write to; `path` names it."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def cache_dir() -> Path:
    """The user's cache folder: $PICTOR_CACHE_DIR, else ($XDG_CACHE_HOME or ~/.cache)/pictor-diffusers."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pictor-diffusers"


def _fallback_dir() -> Path:
    """The per-user temporary folder used when the user's cache cannot be written."""
    user = os.getuid() if _POSIX else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"pictor-diffusers-{user}"


def _problems(info: os.stat_result, kind: str) -> list[str]:
    """Why a folder or file with this `lstat`/`fstat` result cannot be trusted; empty when it can."""
    problems = []
    if stat.S_ISLNK(info.st_mode):
        problems.append("is a symbolic link")
    elif not (stat.S_ISDIR if kind == "folder" else stat.S_ISREG)(info.st_mode):
        problems.append(f"is not a {'directory' if kind == 'folder' else 'regular file'}")
    elif _POSIX and info.st_mode & 0o022:
        problems.append("is writable by group or others")
    if _POSIX and info.st_uid != os.getuid():
        problems.append(f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})")
    return problems


def _make_private_dir(folder: Path) -> None:
    """Create `folder` and its missing parents with mode 0700 whatever the umask; existing ones are left alone."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue  # created meanwhile by another process, or planted: the check decides
        os.chmod(path, 0o700)


def _check_folder(folder: Path) -> None:
    """Raise `UnsafeCacheError` unless `folder` is a real directory of the user's that only the user can write."""
    info = os.lstat(folder)
    problems = _problems(info, "folder")
    if problems:
        raise UnsafeCacheError(
            f"refusing the pictor-diffusers cache folder {folder} (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}): it {' and '.join(problems)}, so another user could plant a "
            f"kernel binary there. Fix: if the folder is yours, `chmod 700 {folder}`; otherwise remove it, "
            f"or set {CACHE_ENV} to a private folder of yours.",
            folder,
        )


def _read_trusted(path: Path, is_valid: Callable[[bytes], bool]) -> bool:
    """Whether `path` is a trusted regular file whose content passes `is_valid`; never follows a link."""
    try:
        if path.is_symlink():  # O_NOFOLLOW does this where it exists; Windows lacks it
            return False
        descriptor = os.open(path, _OPEN_FLAGS)
        with os.fdopen(descriptor, "rb") as handle:
            if _problems(os.fstat(descriptor), "file"):
                return False
            data = handle.read()
    except OSError:
        return False
    return is_valid(data)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` (mode 0600) through a temporary file in the same folder and a rename."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cached_binary(name: str, key: str, build: Callable[[], bytes], is_valid: Callable[[bytes], bool]) -> Path:
    """Path of a cached file `{name}-{sha256(key)[:24]}.cubin`, built by `build()` on a miss.

    Raises `UnsafeCacheError` for a folder another user owns or can write to, `RuntimeError` when
    neither the user's cache nor the temporary fallback can be written; `build`'s errors pass through.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"cache entry name {name!r} must be a plain file name")
    file_name = f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.cubin"
    data: bytes | None = None
    errors = []
    for folder in (cache_dir(), _fallback_dir()):
        try:
            _make_private_dir(folder)
            _check_folder(folder)
        except OSError as error:
            errors.append(f"{folder}: {error}")
            continue
        path = folder / file_name
        if _read_trusted(path, is_valid):
            return path
        if not os.access(folder, os.W_OK | os.X_OK):
            errors.append(f"{folder}: not writable")
            continue
        if data is None:
            data = build()
        try:
            _write_atomic(path, data)
        except OSError as error:
            errors.append(f"{folder}: {error}")
            continue
        return path
    raise RuntimeError(
        f"cannot write the pictor-diffusers binary cache ({'; '.join(errors)}); "
        f"set {CACHE_ENV} to a folder of yours that you can write"
    )
