"""CPU tests of the on-disk binary cache: hits, rebuilds, integrity, modes, locating folders, the fallback."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cache_helpers import BUILT, PLANTED, Build, entry, is_valid, mode, needs_non_root, plant, stored, use_folders

from pictor_diffusers.cuda import cubin_cache
from pictor_diffusers.cuda.cubin_cache import CACHE_ENV, UnsafeCacheError, cache_dir, cached_binary, fallback_dir

pytestmark = pytest.mark.skipif(not cubin_cache.SUPPORTED, reason="POSIX ownership and directory descriptors")


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    return use_folders(monkeypatch, tmp_path)


@pytest.fixture
def primary(folders: tuple[Path, Path]) -> Path:
    return folders[0]


@pytest.fixture
def fallback(folders: tuple[Path, Path]) -> Path:
    return folders[1]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({CACHE_ENV: "/x/pictor", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/pictor"),
        ({CACHE_ENV: "", "XDG_CACHE_HOME": "/x/xdg", "HOME": "/x/home"}, "/x/xdg/pictor-diffusers"),
        ({"HOME": "/x/home"}, "/x/home/.cache/pictor-diffusers"),
        ({CACHE_ENV: "~/pictor", "HOME": "/x/home"}, "/x/home/pictor"),
        ({"XDG_CACHE_HOME": "~/xdg", "HOME": "/x/home"}, "/x/home/xdg/pictor-diffusers"),
        ({"XDG_CACHE_HOME": "relative/xdg", "HOME": "/x/home"}, "/x/home/.cache/pictor-diffusers"),
    ],
)
def test_cache_dir(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str) -> None:
    for name in (CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cache_dir() == Path(expected)


def test_a_relative_pictor_cache_dir_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "relative/cache")
    with pytest.raises(ValueError, match=r"PICTOR_CACHE_DIR='relative/cache' must be an absolute path"):
        cached_binary("kernel", "key", Build(), is_valid)


@pytest.mark.parametrize("error", [RuntimeError("Could not determine home directory."), KeyError("getpwuid")])
def test_no_home_falls_back(monkeypatch: pytest.MonkeyPatch, fallback: Path, error: Exception) -> None:
    for name in (CACHE_ENV, "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home() -> Path:
        raise error

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert cached_binary("kernel", "key", Build(), is_valid) == BUILT
    assert entry(fallback).read_bytes() == stored(BUILT)


def test_the_fallback_is_located_only_when_needed(monkeypatch: pytest.MonkeyPatch, primary: Path) -> None:
    def no_temp() -> Path:
        raise FileNotFoundError("no usable temporary folder")

    monkeypatch.setattr(cubin_cache, "fallback_dir", no_temp)
    assert cached_binary("kernel", "key", Build(), is_valid) == BUILT
    assert entry(primary).read_bytes() == stored(BUILT)


def test_the_fallback_is_never_the_current_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", "relative")
    (tmp_path / "relative").mkdir()
    assert fallback_dir().parent in (Path("/tmp"), Path("/var/tmp"))
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: False if p in ("/tmp", "/var/tmp") else real_isdir(p))
    with pytest.raises(FileNotFoundError, match="no absolute temporary folder"):
        fallback_dir()


def test_miss_builds_once_then_hits(primary: Path, fallback: Path) -> None:
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1
    assert entry(primary).read_bytes() == stored(BUILT)
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1, "a hit rebuilt"
    assert sorted(p.name for p in primary.iterdir()) == [entry(primary).name], "temporary files left behind"
    assert not fallback.exists(), "the temporary fallback was touched"


def test_key_change_makes_a_new_file(primary: Path) -> None:
    build = Build()
    cached_binary("kernel", "key", build, is_valid)
    cached_binary("kernel", "other key", build, is_valid)
    assert build.calls == 2 and entry(primary).exists() and entry(primary, key="other key").exists()


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277], ids="{:04o}".format)
def test_created_folders_are_0700_and_files_0600(tmp_path: Path, primary: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        cached_binary("kernel", "key", Build(), is_valid)
    finally:
        os.umask(old)
    assert [f"{mode(p):04o}" for p in (tmp_path / "home", primary)] == ["0700", "0700"]
    assert f"{mode(entry(primary)):04o}" == "0600"


@pytest.mark.parametrize("folder_mode", [0o700, 0o750, 0o755], ids="{:04o}".format)
def test_existing_private_folder_is_used_as_is(primary: Path, folder_mode: int) -> None:
    plant(entry(primary), folder_mode=folder_mode)
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == PLANTED and build.calls == 0
    assert mode(primary) == folder_mode


CORRUPT = {
    "empty": b"",
    "no trailer": BUILT,
    "truncated": stored(PLANTED)[:-1],
    "content cut": stored(PLANTED)[:3] + stored(PLANTED)[4:],
    "wrong digest": PLANTED + stored(BUILT)[len(BUILT) :],
    "check fails": stored(b"garbage"),
}


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT)
def test_corrupt_or_truncated_entries_are_rebuilt(primary: Path, content: bytes) -> None:
    plant(entry(primary), content)
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1
    assert entry(primary).read_bytes() == stored(BUILT)


def test_rebuild_replaces_an_intact_entry(primary: Path) -> None:
    plant(entry(primary))
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid, rebuild=True) == BUILT and build.calls == 1
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1


def test_stale_temporaries_of_killed_writers_are_removed(primary: Path) -> None:
    stale, fresh = plant(primary / ".kernel-x.cubin.dead.tmp", b"partial"), primary / ".kernel-y.cubin.live.tmp"
    fresh.write_bytes(b"partial")
    hour_ago = time.time() - cubin_cache.STALE_TEMP_SECONDS - 1
    os.utime(stale, (hour_ago, hour_ago))
    cached_binary("kernel", "key", Build(), is_valid)
    assert not stale.exists() and fresh.exists(), "a stale temporary was kept or a live writer's was removed"


def fail_writes(monkeypatch: pytest.MonkeyPatch, folders: list[Path], how: str) -> None:
    """Make `folders` impossible to create (`mkdir`), to write in (`open` for writing) or to rename in."""
    name = {"mkdir": "mkdir", "open": "open", "replace": "replace"}[how]
    real: Callable = getattr(os, name)
    descriptors = {}

    def failing(*args: object, **kwargs: object) -> object:
        parent = kwargs.get("dir_fd") or kwargs.get("dst_dir_fd")
        folder = descriptors.get(parent) if parent is not None else None
        writing = name != "open" or int(args[1]) & os.O_CREAT
        if writing and (folder in folders or Path(str(args[0])) in folders):
            raise OSError(errno.EROFS, "Read-only file system", str(folder or args[0]))
        return real(*args, **kwargs)

    real_open_folder = cubin_cache.open_folder

    def open_folder(folder: Path, create: bool = True) -> int:
        if how == "mkdir" and folder in folders:
            raise OSError(errno.EROFS, "Read-only file system", str(folder))
        descriptor = real_open_folder(folder, create)
        descriptors[descriptor] = folder
        return descriptor

    monkeypatch.setattr(cubin_cache, "open_folder", open_folder)
    monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize("how", ["mkdir", "open", "replace", pytest.param("chmod", marks=needs_non_root)])
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
        assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1
        assert entry(fallback).read_bytes() == stored(BUILT)
        assert mode(fallback) == 0o700 and mode(entry(fallback)) == 0o600
        assert cached_binary("kernel", "key", build, is_valid) == BUILT
        # a cache that accepts the folder but fails the write is only found out after building
        assert build.calls == (1 if how in ("mkdir", "chmod") else 2), "the fallback was not reused"
        assert not primary.exists() or not list(primary.iterdir()), "a partial file was left in the user's cache"
    finally:
        if how == "chmod":
            os.chmod(primary.parent, 0o700)


def test_fallback_is_ignored_on_an_ordinary_miss(primary: Path, fallback: Path) -> None:
    planted = plant(entry(fallback))
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1
    assert planted.read_bytes() == stored(PLANTED)


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
        results.append(cached_binary("kernel", "key", Build(BUILT * 4096), is_valid))

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
