#!/usr/bin/env bash
# The GPU suite twice on the device machine (issue 30): once on an empty kernel cache, then on the same
# cache with every entry truncated to half its size. The second run must pass as the first and leave
# every entry whole again (rebuilt). Usage, from the repo root: bash benchmarks/gpu_cache_check.sh [pytest targets]
# (CORRUPT_TARGETS: a shorter set for the second run, where device time is short).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export PICTOR_CACHE_DIR=/tmp/pictor-cache-check
rm -rf "$PICTOR_CACHE_DIR"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
targets=${*:-$(ls tests/test_gpu_*.py)}
corrupt_targets=${CORRUPT_TARGETS:-$targets}
SECONDS=0
python3 -m pytest -q -rs -x $targets > "$OUT/pytest_empty_cache.log" 2>&1
echo "empty cache: rc=$? $(tail -1 "$OUT/pytest_empty_cache.log") [$SECONDS s]"
python3 -m pictor_diffusers.cache
for f in "$PICTOR_CACHE_DIR"/*.cubin; do truncate -s $(( $(stat -c %s "$f") / 2 )) "$f"; done
echo "truncated $(ls "$PICTOR_CACHE_DIR"/*.cubin | wc -l) entries"
python3 -m pytest -q -rs -x $corrupt_targets > "$OUT/pytest_corrupt_cache.log" 2>&1
echo "corrupted cache: rc=$? $(tail -1 "$OUT/pytest_corrupt_cache.log") [$SECONDS s]"
python3 - <<'PY'
import hashlib, os, pathlib
from pictor_diffusers.cuda.cubin_cache import TRAILER
from pictor_diffusers.cuda.nvrtc import elf_problem
entries = sorted(pathlib.Path(os.environ["PICTOR_CACHE_DIR"]).glob("*.cubin"))
whole = 0
for path in entries:
    data = path.read_bytes()
    content, trailer = data[: -len(TRAILER) - 32], data[-len(TRAILER) - 32 :]
    whole += trailer == TRAILER + hashlib.sha256(content).digest() and elf_problem(content) is None
print(f"after the second run: {whole} of {len(entries)} entries whole")
PY
