"""The on-disk cache of compiled kernel binaries, private to the user (POSIX).

* `cache_dir()`: `$PICTOR_CACHE_DIR`, else `$XDG_CACHE_HOME` or `~/.cache`, then `pictor-diffusers`
  (`~` expanded; a relative `$PICTOR_CACHE_DIR` is an error, a relative `$XDG_CACHE_HOME` is ignored
  as the XDG spec says).
* The folder is opened one path component at a time from `/`, each with `O_NOFOLLOW` relative to its
  parent's descriptor, and every read and write happens relative to the final descriptor: nothing is
  re-opened by name. A symbolic link is followed only where it sits in a trusted folder and is owned by
  root or the user (a symlinked home works; a link planted by another user is refused).
  Every ancestor must be owned by root or the user and not writable by group or others unless it is
  sticky and root-owned (`/tmp`); the cache folder itself must be the user's and writable by no one
  else. Anything else raises `UnsafeCacheError` naming it. Folders it creates are made 0700.
* An entry is trusted only if it is a regular file (not a link) of the user's, writable by no one else,
  whose SHA-256 trailer matches its content and whose content passes the caller's check; the caller
  gets those exact bytes, never a path to open again. Anything else is rebuilt and atomically replaced.
* `<temp>/pictor-diffusers-<uid>` (`$TMPDIR` if absolute, else `/tmp` or `/var/tmp`) is a fallback,
  used only when the user's cache cannot be located, created or written, never on a plain miss.
* Writes go to a temporary file in the same folder, then a rename; temporary files left by a killed
  writer are removed on the next miss once an hour old.

Without POSIX ownership, `O_NOFOLLOW` or directory descriptors nothing is cached: binaries are built
in every process.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE_ENV = "PICTOR_CACHE_DIR"
TRAILER = b"pictor-sha256:"
"""Each entry is `content + TRAILER + sha256(content)`; loaders read only `content`."""
STALE_TEMP_SECONDS = 3600
SUPPORTED = hasattr(os, "getuid") and hasattr(os, "O_NOFOLLOW") and os.open in os.supports_dir_fd
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_DIGEST = len(TRAILER) + hashlib.sha256().digest_size


class UnsafeCacheError(RuntimeError):
    """A cache folder that another user could have planted or can write to; `path` names it."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def cache_dir() -> Path:
    """The user's cache folder: $PICTOR_CACHE_DIR, else ($XDG_CACHE_HOME or ~/.cache)/pictor-diffusers.

    Raises ValueError for a relative $PICTOR_CACHE_DIR, RuntimeError when there is no home folder.
    """
    configured = os.environ.get(CACHE_ENV)
    if configured:
        folder = Path(configured).expanduser()
        if not folder.is_absolute():
            raise ValueError(f"{CACHE_ENV}={configured!r} must be an absolute path")
        return folder
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or "").expanduser()
    if xdg.is_absolute():
        return xdg / "pictor-diffusers"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as error:
        raise RuntimeError(f"no home folder to hold ~/.cache ({error})") from error
    if not home.is_absolute():
        raise RuntimeError(f"the home folder {str(home)!r} is not an absolute path")
    return home / ".cache" / "pictor-diffusers"


def fallback_dir() -> Path:
    """The per-user temporary folder used when the user's cache cannot be written; never the current folder."""
    for candidate in (os.environ.get("TMPDIR", ""), "/tmp", "/var/tmp"):
        if candidate and os.path.isabs(candidate) and os.path.isdir(candidate):
            return Path(candidate) / f"pictor-diffusers-{os.getuid()}"
    raise FileNotFoundError("no absolute temporary folder ($TMPDIR, /tmp, /var/tmp) exists")


def _problems(info: os.stat_result, role: str) -> list[str]:
    """Why a component with this `fstat` result cannot be trusted as `role` ("ancestor", "folder", "file")."""
    is_right_kind = stat.S_ISREG if role == "file" else stat.S_ISDIR
    if not is_right_kind(info.st_mode):
        return [f"is not a {'regular file' if role == 'file' else 'directory'}"]
    problems = []
    owners = (0, os.getuid()) if role == "ancestor" else (os.getuid(),)
    if info.st_uid not in owners:
        problems.append(f"is owned by uid {info.st_uid}, not by you (uid {os.getuid()})")
    shared_sticky = role == "ancestor" and info.st_uid == 0 and info.st_mode & stat.S_ISVTX
    if info.st_mode & 0o022 and not shared_sticky:
        problems.append("is writable by group or others")
    return problems


def _refuse(path: Path, info: os.stat_result | None, problems: list[str]) -> UnsafeCacheError:
    facts = "" if info is None else f" (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
    return UnsafeCacheError(
        f"refusing the pictor-diffusers cache folder {path}{facts}: it {' and '.join(problems)}, so another "
        f"user could plant a kernel binary there. Fix: if the folder is yours, `chmod 700 {path}`; otherwise "
        f"remove it, or set {CACHE_ENV} to a private folder of yours.",
        path,
    )


def _open_child(parent: int, name: str, create: bool) -> int:
    """Descriptor of directory `name` under descriptor `parent`, never following a link; created 0700
    when missing and `create`."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        return _open_child(parent, name, create=False)  # made meanwhile: the checks decide
    descriptor = os.open(name, _DIR_FLAGS, dir_fd=parent)
    os.fchmod(descriptor, 0o700)  # whatever the umask
    return descriptor


def _link_target(parent: int, name: str, path: Path) -> Path | None:
    """Where `name` under the trusted folder `parent` points if it is a symbolic link (None if not).

    A link owned by root or the user inside a trusted folder was placed by one of them and cannot be
    changed by anyone else, so it is followed; any other link is refused.
    """
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(info.st_mode):
        return None
    if info.st_uid not in (0, os.getuid()):
        raise _refuse(path, info, [f"is a symbolic link owned by uid {info.st_uid}"])
    return Path(os.path.normpath(path.parent / os.readlink(name, dir_fd=parent)))


def open_folder(folder: Path, create: bool = True) -> int:
    """A directory descriptor of `folder` whose every component passed the checks (see the module doc).

    Walks from `/` one component at a time, each opened with O_NOFOLLOW relative to its parent; a
    symbolic link (trusted as `_link_target` says) restarts the walk at its target. Raises
    UnsafeCacheError for an untrusted component, OSError when it cannot be opened or created.
    """
    parts, links = list(Path(os.path.normpath(folder)).parts), 0
    while True:
        descriptor, path = os.open("/", _DIR_FLAGS), Path("/")
        try:
            root_problems = _problems(os.fstat(descriptor), "ancestor")
            if root_problems:
                raise _refuse(path, os.fstat(descriptor), root_problems)
            for depth, name in enumerate(parts[1:], start=2):
                target = _link_target(descriptor, name, path / name)
                if target is not None:
                    break
                path = path / name
                child = _open_child(descriptor, name, create)
                os.close(descriptor)
                descriptor = child
                info = os.fstat(descriptor)
                problems = _problems(info, "folder" if depth == len(parts) else "ancestor")
                if problems:
                    raise _refuse(path, info, problems)
            else:
                if len(parts) < 2:
                    raise _refuse(path, None, ["is the root folder"])
                return descriptor
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)
        links += 1
        if links > 40:
            raise OSError(errno.ELOOP, "too many symbolic links", str(folder))
        parts = [*target.parts, *parts[depth:]]


def _read_trusted(folder: int, name: str, is_valid: Callable[[bytes], bool]) -> bytes | None:
    """The content of entry `name` if it is trusted and intact (see the module doc), else None."""
    try:
        descriptor = os.open(name, _FILE_FLAGS, dir_fd=folder)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as handle:
        if _problems(os.fstat(descriptor), "file"):
            return None
        data = handle.read()
    content, trailer = data[:-_DIGEST], data[-_DIGEST:]
    if trailer != TRAILER + hashlib.sha256(content).digest() or not is_valid(content):
        return None
    return content


def _write_atomic(folder: int, name: str, content: bytes) -> None:
    """Write `content` and its trailer to entry `name` (mode 0600) through a temporary file and a rename."""
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    descriptor = os.open(temporary, flags, 0o600, dir_fd=folder)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content + TRAILER + hashlib.sha256(content).digest())
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), 0o600)
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=folder)
        except FileNotFoundError:
            pass
        raise


def remove_stale_temporaries(folder: int, older_than: float = STALE_TEMP_SECONDS) -> int:
    """Delete the `.*.tmp` files of killed writers in descriptor `folder`; returns how many."""
    removed, now = 0, time.time()
    for entry in os.scandir(folder):
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            info = entry.stat(follow_symlinks=False)
            if now - info.st_mtime >= older_than:
                os.unlink(entry.name, dir_fd=folder)
                removed += 1
    return removed


def _folders(errors: list[str]) -> Iterator[Path]:
    """The user's cache, then the fallback, each located only when reached; failures go to `errors`."""
    for locate in (cache_dir, fallback_dir):
        try:
            yield locate()
        except (OSError, RuntimeError) as error:
            errors.append(f"{locate.__name__}(): {error}")


def cached_binary(
    name: str, key: str, build: Callable[[], bytes], is_valid: Callable[[bytes], bool], rebuild: bool = False
) -> bytes:
    """The bytes of cache entry `{name}-{sha256(key)[:24]}.cubin`, built by `build()` on a miss.

    `rebuild`: build and replace the entry even if it looks intact (a binary the driver refused).
    Raises `UnsafeCacheError` for an untrusted folder, ValueError for a relative $PICTOR_CACHE_DIR,
    `RuntimeError` when no folder can be written; `build`'s errors pass through.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"cache entry name {name!r} must be a plain file name")
    if not SUPPORTED:
        return build()
    file_name = f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.cubin"
    data: bytes | None = None
    errors: list[str] = []
    for folder in _folders(errors):
        try:
            descriptor = open_folder(folder)
        except OSError as error:
            errors.append(f"{folder}: {error}")
            continue
        try:
            found = None if rebuild else _read_trusted(descriptor, file_name, is_valid)
            if found is not None:
                return found
            data = build() if data is None else data
            try:
                remove_stale_temporaries(descriptor)
                _write_atomic(descriptor, file_name, data)
            except OSError as error:
                errors.append(f"{folder}: {error}")
                continue
            return data
        finally:
            os.close(descriptor)
    raise RuntimeError(
        f"cannot write the pictor-diffusers binary cache ({'; '.join(errors)}); "
        f"set {CACHE_ENV} to a folder of yours that you can write"
    )
