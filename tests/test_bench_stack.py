"""benchmarks/bench_stack.py's arguments and report.py's stack table, on CPU (the bench itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_stack
import report


def parse(monkeypatch: pytest.MonkeyPatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["bench_stack.py", *argv])
    return bench_stack.parse_args()


def test_defaults_cover_every_backend_and_both_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse(monkeypatch)
    assert args.backends == ["stock", "pictor_bf16", "pictor_fp8"] and args.linears == ["bf16", "fp8"]
    assert args.blocks is None and not args.regional and not args.tune_inductor


@pytest.mark.parametrize("argv", [("--backends", "stock,sage"), ("--linears", "int8")])
def test_unknown_choices_are_named(monkeypatch: pytest.MonkeyPatch, argv: tuple[str, str]) -> None:
    with pytest.raises(SystemExit, match=argv[1].split(",")[-1]):
        parse(monkeypatch, *argv)


def test_blocks_parse_to_double_and_single_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse(monkeypatch, "--blocks", "1,3").blocks == (1, 3)


@pytest.mark.parametrize("image", [1024, 2048])
def test_the_stack_table_and_plot_groups(image: int) -> None:
    records = [
        {"model": "klein-4B", "image": image, "linears": linears, "backend": backend, "ms": ms, "x_stock": x,
         "rel_l2_vs_stock": 1e-3, "compile_s": 40.0}
        for linears in ("bf16", "fp8")
        for backend, ms, x in (("stock", 60.0, 1.0), ("pictor_bf16", 57.0, 0.95), ("pictor_fp8", 50.0, 0.833))
    ]  # fmt: skip
    table = report.stack_table(records).splitlines()
    assert len(table) == 2 + len(records)
    assert f"| klein-4B | {image}² | fp8 | pictor_fp8 | 50.0 | 0.833 |" in table[-1]
    labels, ratios = report.model_ratios(report.stack_as_model(records))
    assert labels == [f"klein-4B\nbf16 linears\n{image}²", f"klein-4B\nfp8 linears\n{image}²"]
    assert ratios == {"pictor_bf16": [0.95, 0.95], "pictor_fp8": [50 / 60, 50 / 60]}
