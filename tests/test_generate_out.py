"""examples/generate.py writes each image (--out, and --compare's stock and difference images) through a temp file in
its folder and `os.replace` (issue 30, item 8): no partial file, and a symlink at the path is replaced, never followed.

The writes run in-process on `save_image`; two tests run the script. test_cli.py has the checks of the paths.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from generate_script import PRECIOUS, files_in, load_generate, run_script
from PIL import Image

pytest.importorskip("transformers", reason="the FLUX.2 pipelines import transformers (extra: examples)")


@pytest.fixture(scope="module")
def save_image() -> Callable[..., None]:
    return load_generate().save_image


def test_save_writes_a_temp_file_in_the_same_folder_then_replaces(
    save_image: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replaced: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def record_replace(src: str, dst: str) -> None:
        replaced.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record_replace)
    save_image(Image.new("RGB", (4, 4), "red"), tmp_path / "x.jpg", overwrite=False)
    [(temp, final)] = replaced
    assert final == tmp_path / "x.jpg" and temp.parent == tmp_path and temp.name.startswith(".x.jpg.")
    assert files_in(tmp_path) == ["x.jpg"]
    assert Image.open(tmp_path / "x.jpg").format == "JPEG"


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temp(
    save_image: Callable[..., None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "x.png").write_bytes(PRECIOUS)

    def save_half(image: Image.Image, file: object, **_: object) -> None:
        file.write(b"\x89PNG half an image")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", save_half)
    with pytest.raises(OSError, match="No space left"):
        save_image(Image.new("RGB", (4, 4)), tmp_path / "x.png", overwrite=True)
    assert files_in(tmp_path) == ["x.png"]
    assert (tmp_path / "x.png").read_bytes() == PRECIOUS


def test_save_replaces_a_symlink_as_a_link_never_its_target(save_image: Callable[..., None], tmp_path: Path) -> None:
    (tmp_path / "target.txt").write_bytes(PRECIOUS)
    (tmp_path / "x.png").symlink_to("target.txt")
    save_image(Image.new("RGB", (4, 4)), tmp_path / "x.png", overwrite=True)
    assert not (tmp_path / "x.png").is_symlink()
    assert Image.open(tmp_path / "x.png").format == "PNG"
    assert (tmp_path / "target.txt").read_bytes() == PRECIOUS


def test_save_refuses_a_file_that_appeared_during_the_run(save_image: Callable[..., None], tmp_path: Path) -> None:
    (tmp_path / "x.png").write_bytes(PRECIOUS)
    with pytest.raises(FileExistsError, match="appeared during the run; pass --overwrite"):
        save_image(Image.new("RGB", (4, 4)), tmp_path / "x.png", overwrite=False)
    assert files_in(tmp_path) == ["x.png"]
    assert (tmp_path / "x.png").read_bytes() == PRECIOUS


def test_a_bad_out_stops_the_script_before_anything_loads(tmp_path: Path) -> None:
    (tmp_path / "pictures").mkdir()
    result = run_script("--tiny", "--out", "pictures", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stdout == "", "nothing runs (no pipeline, no CPU note) before the check"
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("generate.py: error: --out 'pictures': is a directory")


def test_overwrite_replaces_symlinks_at_all_three_images_never_their_targets(tmp_path: Path) -> None:
    names = ("x.png", "x_stock.png", "x_diff.png")
    for name in names:
        (tmp_path / f"{name}.target").write_bytes(PRECIOUS)
        (tmp_path / name).symlink_to(f"{name}.target")
    args = ("--tiny", "--steps", "1", "--height", "32", "--width", "32", "--compare", "--out", "x.png", "--overwrite")
    result = run_script(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for name in names:
        assert not (tmp_path / name).is_symlink()
        assert Image.open(tmp_path / name).size == (32, 32)
        assert (tmp_path / f"{name}.target").read_bytes() == PRECIOUS
    assert sorted(files_in(tmp_path)) == sorted([*names, *(f"{name}.target" for name in names)])
