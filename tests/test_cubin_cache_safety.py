"""CPU tests of what the binary cache refuses: planted or shared folders and ancestors, links, foreign
files; and that the runtime loads the very bytes the cache checked (no re-open by path)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from cache_helpers import BUILT, OTHER_UID, PLANTED, Build, entry, is_valid, mode, needs_root, plant, stored
from cache_helpers import use_folders as use_test_folders

from pictor_diffusers.cuda import cubin_cache, nvrtc, runtime
from pictor_diffusers.cuda.cubin_cache import CACHE_ENV, UnsafeCacheError, cached_binary
from pictor_diffusers.cuda.registry import BY_NAME, variants

pytestmark = pytest.mark.skipif(not cubin_cache.SUPPORTED, reason="POSIX ownership and directory descriptors")


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    return use_test_folders(monkeypatch, tmp_path)


def refused(folder: Path) -> str:
    """The message of the UnsafeCacheError a lookup raises, which must name `folder`; nothing is built."""
    build = Build()
    with pytest.raises(UnsafeCacheError) as caught:
        cached_binary("kernel", "key", build, is_valid)
    assert caught.value.path == folder and str(folder) in str(caught.value) and build.calls == 0
    assert "chmod 700" in str(caught.value) and CACHE_ENV in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("folder_mode", ["0777", "0770", "0720", "0702"])
@pytest.mark.parametrize("which", ["user cache", "fallback"])
def test_a_shared_cache_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, folders: tuple[Path, Path], which: str, folder_mode: str
) -> None:
    primary, fallback = folders
    if which == "fallback":
        monkeypatch.setenv(CACHE_ENV, "/proc/pictor-cannot-exist")
    folder = primary if which == "user cache" else fallback
    plant(entry(folder), folder_mode=int(folder_mode, 8))
    assert f"mode {folder_mode}" in refused(folder)


@needs_root
@pytest.mark.parametrize("how", ["chown", "simulated"])
def test_a_foreign_cache_folder_is_refused(
    monkeypatch: pytest.MonkeyPatch, folders: tuple[Path, Path], how: str
) -> None:
    primary, _ = folders
    plant(entry(primary))
    if how == "chown":
        os.chown(primary, OTHER_UID, OTHER_UID)
    else:
        monkeypatch.setattr(os, "getuid", lambda: OTHER_UID)
    assert "not by you" in refused(primary)


@pytest.mark.parametrize("parent_mode", [0o777, 0o770, 0o702])
def test_a_shared_ancestor_is_refused(folders: tuple[Path, Path], parent_mode: int) -> None:
    primary, _ = folders
    plant(entry(primary))
    os.chmod(primary.parent, parent_mode)
    assert "writable by group or others" in refused(primary.parent)


@needs_root
def test_a_sticky_ancestor_must_be_roots(folders: tuple[Path, Path]) -> None:
    primary, _ = folders
    plant(entry(primary))
    os.chmod(primary.parent, 0o1777)
    assert cached_binary("kernel", "key", Build(), is_valid) == PLANTED, "a root-owned sticky folder (/tmp) was refused"
    os.chown(primary.parent, OTHER_UID, OTHER_UID)
    assert f"owned by uid {OTHER_UID}" in refused(primary.parent)


def test_a_link_to_a_shared_folder_in_the_parent_path_is_refused(tmp_path: Path, folders: tuple[Path, Path]) -> None:
    primary, _ = folders
    shared = tmp_path / "shared"
    plant(entry(shared / "cache"), folder_mode=0o700)
    os.chmod(shared, 0o777)
    primary.parent.symlink_to(shared, target_is_directory=True)
    assert "writable by group or others" in refused(shared)


@pytest.mark.parametrize("target_mode", [0o777, 0o770])
def test_a_link_as_the_cache_folder_is_held_to_its_target(
    tmp_path: Path, folders: tuple[Path, Path], target_mode: int
) -> None:
    primary, _ = folders
    target = tmp_path / "elsewhere"
    plant(entry(target), folder_mode=target_mode)
    primary.parent.mkdir(mode=0o700)
    primary.symlink_to(target, target_is_directory=True)
    refused(target)


def test_a_users_own_link_to_a_private_folder_is_followed(tmp_path: Path, folders: tuple[Path, Path]) -> None:
    """A symlinked home or cache (a link of the user's inside a folder only the user can change) works."""
    primary, _ = folders
    target = plant(entry(tmp_path / "real-home" / "cache")).parent
    primary.parent.symlink_to(target.parent, target_is_directory=True)
    assert cached_binary("kernel", "key", Build(), is_valid) == PLANTED


@needs_root
def test_a_link_owned_by_another_user_is_refused(tmp_path: Path, folders: tuple[Path, Path]) -> None:
    primary, _ = folders
    target = plant(entry(tmp_path / "real-home" / "cache")).parent
    primary.parent.symlink_to(target.parent, target_is_directory=True)
    os.lchown(primary.parent, OTHER_UID, OTHER_UID)
    assert "symbolic link owned by uid" in refused(primary.parent)


@pytest.mark.parametrize(
    "kind", ["symlink", "group-writable", "other-writable", pytest.param("chown", marks=needs_root)]
)
def test_an_untrusted_file_is_never_loaded(tmp_path: Path, folders: tuple[Path, Path], kind: str) -> None:
    primary, _ = folders
    path = entry(primary)
    if kind == "symlink":
        target = plant(tmp_path / "elsewhere" / "planted.cubin")
        primary.mkdir(parents=True, mode=0o700)
        path.symlink_to(target)
    else:
        plant(path, file_mode={"group-writable": 0o620, "other-writable": 0o602}.get(kind, 0o600))
        if kind == "chown":
            os.chown(path, OTHER_UID, OTHER_UID)
    build = Build()
    assert cached_binary("kernel", "key", build, is_valid) == BUILT and build.calls == 1
    assert not path.is_symlink() and path.read_bytes() == stored(BUILT) and mode(path) == 0o600
    if kind == "symlink":
        assert target.read_bytes() == stored(PLANTED), "the link's target was written through"


class FakeCupy:
    """Just enough of CuPy for `nvrtc._load`: records each module load; `refuse` loads fail first."""

    def __init__(self, refuse: int = 0) -> None:
        self.loaded: list[bytes] = []
        self.refuse = refuse
        fake = self

        class Module:
            def load(self, data: bytes) -> None:
                fake.loaded.append(data)
                if len(fake.loaded) <= fake.refuse:
                    raise self.Error("CUDA_ERROR_INVALID_IMAGE")

            def load_file(self, path: str) -> None:
                raise AssertionError(f"a cubin was re-opened by path: {path}")

            def get_function(self, name: str) -> SimpleNamespace:
                return SimpleNamespace(ptr=1234)

        class DriverError(Exception):
            pass

        Module.Error = DriverError
        driver = SimpleNamespace(CUDADriverError=DriverError, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=8,
                                 funcSetAttribute=lambda *args: None)  # fmt: skip
        self.cuda = SimpleNamespace(Device=lambda index: contextlib.nullcontext(), driver=driver,
                                    function=SimpleNamespace(Module=Module))  # fmt: skip


def fake_runtime(monkeypatch: pytest.MonkeyPatch, fake: FakeCupy, after_check: object) -> list[bool]:
    """Route `nvrtc._load` through the real cache with a fake compiler; `after_check(path)` runs between
    the cache's checks and the load. Returns the `rebuild` flags the cache was asked with."""
    asked: list[bool] = []

    def cached_module(variant: object, capability: tuple[int, int], rebuild: bool = False) -> bytes:
        asked.append(rebuild)
        data = cached_binary("kernel", "key", Build(), is_valid, rebuild)
        after_check(entry(Path(os.environ[CACHE_ENV])))
        return data

    monkeypatch.setattr(runtime, "import_cupy", lambda: fake)
    monkeypatch.setattr(nvrtc, "load_nvrtc_library", lambda: None)
    monkeypatch.setattr(nvrtc, "device_facts", lambda index: ((9, 0), 232448))
    monkeypatch.setattr(nvrtc, "cached_module", cached_module)
    return asked


def test_the_loaded_bytes_are_the_checked_bytes(monkeypatch: pytest.MonkeyPatch, folders: tuple[Path, Path]) -> None:
    """A file swapped for a planted one between the check and the load is never what gets loaded."""
    fake = FakeCupy()

    def swap(path: Path) -> None:
        path.unlink()
        plant(path)

    fake_runtime(monkeypatch, fake, swap)
    _, handle = nvrtc._load(variants(BY_NAME["mma16"])[0], 0)
    assert fake.loaded == [BUILT] and handle == 1234


@pytest.mark.parametrize("refusals", [1, 2])
def test_a_cubin_the_driver_refuses_is_rebuilt_once(
    monkeypatch: pytest.MonkeyPatch, folders: tuple[Path, Path], refusals: int
) -> None:
    fake = FakeCupy(refuse=refusals)
    asked = fake_runtime(monkeypatch, fake, lambda path: None)
    if refusals == 1:
        nvrtc._load(variants(BY_NAME["mma16"])[0], 0)
    else:
        with pytest.raises(Exception, match="CUDA_ERROR_INVALID_IMAGE"):
            nvrtc._load(variants(BY_NAME["mma16"])[0], 0)
    assert asked == [False, True] and len(fake.loaded) == 2
