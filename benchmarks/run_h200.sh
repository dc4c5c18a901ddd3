#!/usr/bin/env bash
# One device call: install diffusers wheels, GPU + CPU tests, sanitizers, ncu, benchmark.
# Usage on the H200 machine (from the repo root): bash benchmarks/run_h200.sh "<bench shapes>"
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"

python3 -m pytest -q -rs -s ${PYTEST_TARGETS:-tests} 2>&1 | tee "$OUT/pytest.log" | grep -E "x8|rel err|KLEIN4B|passed|failed|SKIP|^E  " | tail -40

for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitizer_cases.py > "$OUT/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
done

ncu --clock-control none -k regex:joint_attention -c 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 > "$OUT/ncu.log" 2>&1
grep -E "joint_attention|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued" "$OUT/ncu.log"

python3 benchmarks/bench_kernel.py --shapes "${1:-1x24x1536x128,1x24x4608x128,1x48x4608x128}" \
  --json "$OUT/kernel_h200.json"

python3 benchmarks/bench_model.py --models "${MODELS:-klein-4B}" --sizes "${SIZES:-1024,2048}" \
  --reps 3 --json "$OUT/model_h200.json"
