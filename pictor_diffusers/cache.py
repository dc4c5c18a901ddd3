"""`python -m pictor_diffusers.cache`: show or clear the compiled-kernel cache.

Each entry is one kernel variant's cubin for one GPU arch (15-100 KB on Hopper); a process loads only the
variants it runs, so a FLUX.2 user's cache holds a few, and a new NVRTC or pictor release adds new
entries beside the old ones. `--clear` removes them all (and killed writers' temporary files); they
are rebuilt on next use, 0.2-2 s per kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .cuda import cubin_cache


def _folders() -> list[Path]:
    """The user's cache and the temporary fallback, as far as they can be located."""
    found = []
    for locate in (cubin_cache.cache_dir, cubin_cache.fallback_dir):
        try:
            found.append(locate())
        except (OSError, RuntimeError):
            continue
    return found


def _visit(folder: Path, clear: bool) -> tuple[int, int]:
    """(entries, bytes) of one cache folder, removing them (and every temporary file) when `clear`."""
    descriptor = cubin_cache.open_folder(folder, create=False)
    try:
        count = size = 0
        for item in os.scandir(descriptor):
            if not item.is_file(follow_symlinks=False):
                continue
            is_entry = item.name.endswith(".cubin") and not item.name.startswith(".")
            if is_entry:
                count, size = count + 1, size + item.stat(follow_symlinks=False).st_size
            if clear and (is_entry or item.name.endswith(".tmp")):
                os.unlink(item.name, dir_fd=descriptor)
        return count, size
    finally:
        os.close(descriptor)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pictor_diffusers.cache", description=__doc__)
    parser.add_argument("--clear", action="store_true", help="remove every cached kernel binary")
    args = parser.parse_args(argv)
    if not cubin_cache.SUPPORTED:
        print("this system keeps no kernel cache (binaries are built in every process)")
        return 0
    for folder in _folders():
        try:
            count, size = _visit(folder, args.clear)
        except FileNotFoundError:
            print(f"{folder}: no cache")
            continue
        except (OSError, cubin_cache.UnsafeCacheError) as error:
            print(f"{folder}: {error}", file=sys.stderr)
            return 1
        verb = "removed" if args.clear else "holds"
        print(f"{folder}: {verb} {count} kernel binaries, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
