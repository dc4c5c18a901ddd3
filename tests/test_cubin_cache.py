"""CPU tests of the on-disk binary cache: hits, rebuilds, modes, planted folders and files, the fallback."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pictor_diffusers import cubin_cache
from pictor_diffusers.cubin_cache import CACHE_ENV, UnsafeCacheError, cache_dir, cached_binary

pytestmark = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership and permission bits")

BUILT = b"\x7fELF\x02 built"
PLANTED = b"\x7fELF\x02 planted"
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 54321
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")
needs_non_root = pytest.mark.skipif(IS_ROOT, reason="root writes through permission bits")


def is_valid(data: bytes) -> bool:
    return data.startswith(b"\x7fELF")


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


def plant(path: Path, data: bytes = PLANTED, folder_mode: int = 0o700, file_mode: int = 0o600) -> Path:
    """Create `path` with `data` inside a folder of mode `folder_mode`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, file_mode)
    os.chmod(path.parent, folder_mode)
    return path


@pytest.fixture
def primary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The user's cache folder (not yet created); the temporary folder is moved under tmp_path too."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "home" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "home" / "cache"


@pytest.fixture
def fallback(primary: Path, tmp_path: Path) -> Path:
    return tmp_path / "tmp" / f"pictor-diffusers-{os.getuid()}"


def fail_writes(monkeypatch: pytest.MonkeyPatch, folders: list[Path], how: str) -> None:
    """Make `folders` impossible to create (`mkdir`), unwritable (`access`) or failing at the rename (`replace`)."""
    real: Callable = getattr(os, how)

    def failing(*args: object, **kwargs: object) -> object:
        target = Path(str(args[1] if how == "replace" else args[0]))
        if target in folders or target.parent in folders:
            if how == "access":
                return False
            raise OSError(errno.EROFS, "Read-only file system", str(target))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, how, failing)


def pretend_foreign_file(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Make `os.fstat` report `path` (by inode) as owned by another user."""
    real_fstat, planted = os.fstat, os.lstat(path)

    def fstat(descriptor: int) -> os.stat_result:
        info = real_fstat(descriptor)
        if (info.st_dev, info.st_ino) != (planted.st_dev, planted.st_ino):
            return info
        fields = list(info[:10])
        fields[4] = OTHER_UID
        return os.stat_result(fields)

    monkeypatch.setattr(os, "fstat", fstat)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({CACHE_ENV: "/x/pictor", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/pictor"),
        ({CACHE_ENV: "", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/xdg/pictor-diffusers"),
        ({"HOME": "/x/home"}, "/x/home/.cache/pictor-diffusers"),
    ],
)
def test_cache_dir(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str) -> None:
    for name in (CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cache_dir() == Path(expected)


def test_miss_builds_once_then_hits(primary: Path, fallback: Path) -> None:
    build = Build()
    first = cached_binary("kernel", "key", build, is_valid)
    assert first == entry(primary) and first.read_bytes() == BUILT and build.calls == 1
    assert cached_binary("kernel", "key", build, is_valid) == first and build.calls == 1, "a hit rebuilt"
    assert sorted(p.name for p in primary.iterdir()) == [first.name], "temporary files left behind"
    assert not fallback.exists(), "the temporary fallback was touched"


def test_key_change_makes_a_new_file(primary: Path) -> None:
    build = Build()
    first = cached_binary("kernel", "key", build, is_valid)
    second = cached_binary("kernel", "other key", build, is_valid)
    assert second == entry(primary, key="other key") != first and build.calls == 2
    assert first.exists() and second.exists()


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277], ids="{:04o}".format)
def test_created_folders_are_0700_and_files_0600(tmp_path: Path, primary: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        path = cached_binary("kernel", "key", Build(), is_valid)
    finally:
        os.umask(old)
    assert [f"{mode(p):04o}" for p in (tmp_path / "home", primary)] == ["0700", "0700"]
    assert f"{mode(path):04o}" == "0600"


@pytest.mark.parametrize("folder_mode", [0o700, 0o750, 0o755], ids="{:04o}".format)
def test_existing_private_folder_is_used_as_is(primary: Path, folder_mode: int) -> None:
    plant(entry(primary), folder_mode=folder_mode)
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid).read_bytes() == PLANTED and build.calls == 0
    assert mode(primary) == folder_mode


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x7fEL"])
def test_invalid_cached_content_is_rebuilt(primary: Path, content: bytes) -> None:
    plant(entry(primary), content)
    build = Build()
    path = cached_binary("kernel", "key", build, is_valid)
    assert path == entry(primary) and path.read_bytes() == BUILT and build.calls == 1


MODES = ["0777", "0770", "0720", "0702"]
UNSAFE_FOLDERS = [*MODES, "foreign-simulated", pytest.param("chown", marks=needs_root), "symlink", "dangling-symlink"]


def plant_unsafe_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: Callable[[], Path], kind: str) -> Path:
    """Plant the folder `where()` names, holding a valid entry, made unsafe as `kind` says; return its path."""
    if kind == "foreign-simulated":
        monkeypatch.setattr(os, "getuid", lambda: OTHER_UID)
    folder = where()
    if kind.endswith("symlink"):
        if kind == "symlink":
            plant(entry(tmp_path / "elsewhere"))
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        return folder
    plant(entry(folder), folder_mode=int(kind, 8) if kind.isdigit() else 0o700)
    if kind == "chown":
        os.chown(folder, OTHER_UID, OTHER_UID)
    return folder


@pytest.mark.parametrize("kind", UNSAFE_FOLDERS)
@pytest.mark.parametrize("which", ["user cache", "fallback"])
def test_unsafe_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, primary: Path, which: str, kind: str
) -> None:
    if which == "fallback":
        fail_writes(monkeypatch, [primary], "mkdir")
        folder = plant_unsafe_folder(
            monkeypatch, tmp_path, lambda: Path(tempfile.gettempdir()) / f"pictor-diffusers-{os.getuid()}", kind
        )
    else:
        folder = plant_unsafe_folder(monkeypatch, tmp_path, lambda: primary, kind)
    build = Build()
    with pytest.raises(UnsafeCacheError) as caught:
        cached_binary("kernel", "key", build, is_valid)
    message = str(caught.value)
    assert caught.value.path == folder and str(folder) in message and build.calls == 0
    assert "chmod 700" in message and CACHE_ENV in message
    reason = {"foreign-simulated": "not by you", "chown": f"owner uid {OTHER_UID}"}.get(kind, f"mode {kind}")
    assert ("symbolic link" if kind.endswith("symlink") else reason) in message


@pytest.mark.parametrize(
    "kind",
    ["symlink", "group-writable", "other-writable", "foreign-simulated", pytest.param("chown", marks=needs_root)],
)
def test_untrusted_file_is_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, primary: Path, kind: str
) -> None:
    path = entry(primary)
    if kind == "symlink":
        target = plant(tmp_path / "elsewhere" / "planted.cubin")
        primary.mkdir(parents=True, mode=0o700)
        path.symlink_to(target)
    else:
        plant(path, file_mode={"group-writable": 0o620, "other-writable": 0o602}.get(kind, 0o600))
        if kind == "chown":
            os.chown(path, OTHER_UID, OTHER_UID)
        elif kind == "foreign-simulated":
            pretend_foreign_file(monkeypatch, path)
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == path and build.calls == 1
    assert not path.is_symlink() and path.read_bytes() == BUILT and mode(path) == 0o600
    if kind == "symlink":
        assert target.read_bytes() == PLANTED, "the link's target was written through"


@pytest.mark.parametrize("how", ["mkdir", "access", "replace", pytest.param("chmod", marks=needs_non_root)])
def test_unwritable_user_cache_falls_back_to_the_temporary_folder(
    monkeypatch: pytest.MonkeyPatch, primary: Path, fallback: Path, how: str
) -> None:
    if how == "chmod":
        primary.parent.mkdir()
        os.chmod(primary.parent, 0o500)
    else:
        fail_writes(monkeypatch, [primary], how)
    try:
        build = Build()
        path = cached_binary("kernel", "key", build, is_valid)
        assert path == entry(fallback) and path.read_bytes() == BUILT and build.calls == 1
        assert mode(fallback) == 0o700 and mode(path) == 0o600
        again = cached_binary("kernel", "key", build, is_valid)
        # a cache that accepts the folder but fails the write is only found out after building
        assert again == path and build.calls == (2 if how == "replace" else 1), "the fallback was not reused"
        assert not primary.exists() or not list(primary.iterdir()), "a partial file was left in the user's cache"
    finally:
        if how == "chmod":
            os.chmod(primary.parent, 0o700)


def test_fallback_is_ignored_on_an_ordinary_miss(primary: Path, fallback: Path) -> None:
    planted = plant(entry(fallback))
    build = Build()
    path = cached_binary("kernel", "key", build, is_valid)
    assert path == entry(primary) and path.read_bytes() == BUILT and build.calls == 1
    assert planted.read_bytes() == PLANTED


def test_both_unwritable_names_both_folders(monkeypatch: pytest.MonkeyPatch, primary: Path, fallback: Path) -> None:
    fail_writes(monkeypatch, [primary, fallback], "mkdir")
    with pytest.raises(RuntimeError) as caught:
        cached_binary("kernel", "key", Build(), is_valid)
    message = str(caught.value)
    assert not isinstance(caught.value, UnsafeCacheError)
    assert str(primary) in message and str(fallback) in message and "Read-only" in message and CACHE_ENV in message


def test_build_errors_pass_through(primary: Path, fallback: Path) -> None:
    def build() -> bytes:
        raise OSError(errno.ENOENT, "no NVRTC")

    with pytest.raises(OSError, match="no NVRTC"):
        cached_binary("kernel", "key", build, is_valid)
    assert not fallback.exists() and not list(primary.iterdir())


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden"])
def test_names_must_be_plain_file_names(primary: Path, name: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        cached_binary(name, "key", Build(), is_valid)


def test_concurrent_writers_never_expose_a_partial_file(primary: Path) -> None:
    start, results = threading.Barrier(8), []

    def worker() -> None:
        start.wait()
        results.append(cached_binary("kernel", "key", Build(BUILT * 4096), is_valid).read_bytes())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [BUILT * 4096] * 8
    assert [p.name for p in primary.iterdir()] == [entry(primary).name], "temporary files left behind"


def test_no_state_is_kept_between_calls(primary: Path) -> None:
    cached_binary("kernel", "key", Build(), is_valid)
    entry(primary).unlink()
    build = Build()
    cached_binary("kernel", "key", build, is_valid)
    assert build.calls == 1, "a deleted file was remembered"
    assert not any(isinstance(v, dict | list | set) for k, v in vars(cubin_cache).items() if not k.startswith("__"))
