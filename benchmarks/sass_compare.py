"""Is the machine code of every kernel build the same as at a base commit? A CPU-only check (no GPU).

Compiles every build the registry makes, at the base commit (a `git worktree` of it under `.scratch/`)
and in this working tree, with each tree's own registry and `nvrtc.compile_cubin`, then compares:

* the SASS listing, `cuobjdump -sass` verbatim: instructions and their encodings, function names and
  header flags. Nothing is stripped: no line of it names a file or a path, and NVRTC writes no debug or
  line information without -G / -lineinfo, which no build passes;
* `cuobjdump -res-usage` (registers, stack, shared, local, constant bank sizes);
* the cubin's bytes (not required to match: the ELF also holds what the SASS does not show).

The builds: every attention variant (`variants(spec)` of each row of `KERNELS`), every prologue build
(its head dims x input x output dtypes), the split and the two quantise builds; each for the arch a
compute capability 9.0 device loads (`variant.arch((9, 0))`: sm_90a for the Hopper rows, else sm_90)
and, where the row runs there, for sm_80.

Builds compile in one process, one at a time; each tree's results are cached under `.scratch/sass/`,
keyed by the texts that reach NVRTC (the `.cu` source and the headers it includes, transitively), the
options, the arch, the NVRTC version and the tree's `nvrtc.py`, so an unchanged build never compiles twice.

    python benchmarks/sass_compare.py --base 75a7f38 --json benchmarks/results/sass_compare.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRATCH = ROOT / ".scratch" / "sass"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _tool(name: str) -> str:
    """A CUDA tool from PATH, beside ptxas, or from NVIDIA's pip wheels."""
    places = [os.environ.get("PATH", "")]
    if ptxas := shutil.which("ptxas"):
        places.append(str(Path(ptxas).resolve().parent))
    try:
        import nvidia

        places += [str(folder) for root in nvidia.__path__ for folder in Path(root).glob("*/bin")]
    except ImportError:
        pass
    found = next((hit for place in places if (hit := shutil.which(name, path=place))), None)
    if found is None:
        raise SystemExit(f"{name} not found (PATH, beside ptxas, or pip's nvidia-cuda-cuobjdump)")
    return found


def _module(tree: Path, stem: str):
    """The tree's `pictor_diffusers` module named `<stem>.py`, wherever in the package it now lives."""
    hits = sorted((tree / "pictor_diffusers").rglob(f"{stem}.py"), key=lambda p: len(p.parts))
    if not hits:
        raise SystemExit(f"no {stem}.py under {tree / 'pictor_diffusers'}")
    dotted = ".".join(hits[0].relative_to(tree).with_suffix("").parts)
    return importlib.import_module(dotted), hits[0]


def _builds(registry, pass_rows) -> list[tuple[object, str]]:
    """(variant, arch) for every build the registry makes (attention rows in `registry`, prologue and prepass
    rows in `pass_rows`), for a 9.0 device and, where it runs, for sm_80."""
    dtypes = ("float32", "bfloat16", "float16")
    found = [v for spec in registry.KERNELS for v in registry.variants(spec)]
    found += [pass_rows.prologue_variant(d, i, o) for d in pass_rows.PROLOGUE.head_dims for i in dtypes for o in dtypes]
    schemes = [("0",), ("1",)] if "pv" in inspect.signature(pass_rows.quantize_variant).parameters else [()]
    quantizers = [pass_rows.quantize_variant(128, i, *s) for i in ("bfloat16", "float16") for s in schemes]
    found += [pass_rows.split_variant(128), *quantizers]
    builds = []
    for variant in found:
        builds.append((variant, variant.arch((9, 0))))
        if not variant.spec.arch_suffix and variant.spec.min_capability <= (8, 0):
            builds.append((variant, variant.arch((8, 0))))
    return builds


def _included(kernels: Path, name: str, seen: dict[str, str]) -> None:
    """The texts of `name` and of every header it includes, transitively, into `seen`."""
    if name in seen or not (kernels / name).is_file():
        return
    seen[name] = (kernels / name).read_text(encoding="utf-8")
    for header in INCLUDE.findall(seen[name]):
        _included(kernels, header, seen)


def dump(tree: Path, dest: Path) -> None:
    """Compile each of the tree's builds not yet in `dest`; write its cubin, SASS and resource usage there."""
    sys.path.insert(0, str(tree))
    registry, _ = _module(tree, "registry")
    has_pass_rows = any((tree / "pictor_diffusers").rglob("pass_rows.py"))
    pass_rows = _module(tree, "pass_rows")[0] if has_pass_rows else registry  # older trees: one table
    nvrtc, nvrtc_file = _module(tree, "nvrtc")
    sources, _ = _module(tree, "sources")
    cuobjdump = _tool("cuobjdump")
    version = repr(nvrtc.nvrtc_version())
    dest.mkdir(parents=True, exist_ok=True)
    index = {}
    for variant, arch in _builds(registry, pass_rows):
        texts: dict[str, str] = {}
        _included(tree / "kernels", variant.spec.source, texts)
        key_parts = [*(f"{n}\0{t}" for n, t in sorted(texts.items())), *variant.options(), arch, version]
        key = hashlib.sha256("\0".join([*key_parts, nvrtc_file.read_text()]).encode()).hexdigest()[:20]
        build = f"{variant.name}-{arch}"
        stem = dest / f"{build}-{key}"
        index[build] = stem.name
        if (stem.with_suffix(".res")).is_file():
            continue
        if any(sources.read_source(name) != text for name, text in texts.items()):
            raise SystemExit(f"{tree / 'kernels'} changed while this dump ran; run it again")
        cubin = stem.with_suffix(".cubin")
        cubin.write_bytes(nvrtc.compile_cubin(variant, arch))
        for flag, suffix in (("-sass", ".sass"), ("-res-usage", ".res")):
            out = subprocess.run([cuobjdump, flag, str(cubin)], capture_output=True, text=True, check=True).stdout
            # -res-usage names the file it read; the key-hashed name is not part of the build
            stem.with_suffix(suffix).write_text(out.replace(str(cubin), "<cubin>"), encoding="utf-8")
        print(f"compiled {build}", flush=True)
    (dest / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True), encoding="utf-8")
    (dest / "nvrtc.txt").write_text(version, encoding="utf-8")


def _run_dump(tree: Path, dest: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, __file__, "--dump", str(tree), str(dest)], env=env, check=True, cwd=tree)
    return json.loads((dest / "index.json").read_text(encoding="utf-8"))


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def _kernels_digest(tree: Path) -> str:
    """sha256 over the names and texts of the tree's kernels/ files: which sources a record compared."""
    digest = hashlib.sha256()
    for path in sorted((tree / "kernels").iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _differing_lines(a: str, b: str) -> int:
    la, lb = a.splitlines(), b.splitlines()
    return sum(x != y for x, y in zip(la, lb, strict=False)) + abs(len(la) - len(lb))


def compare(base: str, record: Path | None) -> int:
    sha = _git("rev-parse", base)
    tree = SCRATCH / f"tree-{sha[:12]}"
    if not tree.is_dir():
        _git("worktree", "add", "--detach", str(tree), sha)
    before_dir, after_dir = SCRATCH / f"base-{sha[:12]}", SCRATCH / "work"
    before, after = _run_dump(tree, before_dir), _run_dump(ROOT, after_dir)
    rows, same_sass, same_res, same_bytes = [], 0, 0, 0
    for build in sorted(set(before) | set(after)):
        if build not in before or build not in after:
            rows.append({"build": build, "only_in": "base" if build in before else "work"})
            continue
        b, a = before_dir / before[build], after_dir / after[build]
        sass_b, sass_a = (p.with_suffix(".sass").read_text(encoding="utf-8") for p in (b, a))
        res_equal = b.with_suffix(".res").read_text() == a.with_suffix(".res").read_text()
        bytes_equal = b.with_suffix(".cubin").read_bytes() == a.with_suffix(".cubin").read_bytes()
        same_sass += sass_a == sass_b
        same_res += res_equal
        same_bytes += bytes_equal
        if sass_a != sass_b or not res_equal:
            rows.append({"build": build, "sass_lines_differing": _differing_lines(sass_b, sass_a), "res": res_equal})
    compared = len(set(before) & set(after))
    result = {
        "base_commit": sha,
        "work_commit": _git("rev-parse", "HEAD"),
        "work_tree_clean_in_kernels": not _git("status", "--porcelain", "--", "kernels"),
        "work_kernels_digest": _kernels_digest(ROOT),
        "tools": {
            "nvrtc": (after_dir / "nvrtc.txt").read_text(encoding="utf-8"),
            "cuobjdump": subprocess.run([_tool("cuobjdump"), "--version"], capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1],
        },
        "stripped_before_comparing": "nothing (cuobjdump -sass verbatim; -res-usage with the cubin's path removed)",
        "builds_compared": compared,
        "sass_identical": same_sass,
        "res_usage_identical": same_res,
        "cubin_bytes_identical": same_bytes,
        "builds_per_arch": {
            arch: sum(b.endswith(f"-{arch}") for b in set(before) & set(after)) for arch in ("sm_80", "sm_90", "sm_90a")
        },
        "differences": rows,
    }
    text = json.dumps(result, indent=2) + "\n"
    if record is not None:
        record.write_text(text, encoding="utf-8")
    print(text)
    return 0 if same_sass == compared and same_res == compared and not rows else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="the commit whose builds are the reference")
    parser.add_argument("--json", type=Path, help="write the comparison record here")
    parser.add_argument("--dump", nargs=2, metavar=("TREE", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dump:
        dump(Path(args.dump[0]), Path(args.dump[1]))
        return 0
    return compare(args.base, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
