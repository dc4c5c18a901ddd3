#!/usr/bin/env bash
# One device call (~8 min on an H200): install diffusers wheels, GPU + CPU tests, sanitizers, ncu, benchmarks.
# Usage on the H200 machine (from the repo root): bash benchmarks/run_h200.sh ["<bench shapes>"]
# Env: PYTEST_TARGETS (default tests), MODELS (default klein-4B,klein-9B,dev), SIZES (default 1024; 2048 adds
# 16896-token rows), BENCH_ROWS (bench_kernel --rows; default all rows), PART (test | bench | all, default all:
# "test" = pytest, sanitizers, ncu, overheads; "bench" = benchmarks and the tiny generation, for two calls under
# 10 min), AB_BASELINE (a checkout of an earlier commit: its overheads, and an interleaved A/B of every kernel row).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)"
SECONDS=0
stamp() { echo "[$SECONDS s] $*"; }

PART=${PART:-all}
if [ "$PART" != bench ]; then
python3 -m pytest -q -rs -s ${PYTEST_TARGETS:-tests} 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "x8|rel err|KLEIN4B|KERNEL16|stock math vs default|passed|failed|SKIP|^E  " | tail -60
stamp pytest done

for tool in memcheck racecheck; do
  compute-sanitizer --tool $tool --error-exitcode 9 python3 benchmarks/sanitizer_cases.py > "$OUT/sanitize_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
done
stamp sanitizers done

NCU_SECTIONS="--section SpeedOfLight --section Occupancy --section WarpStateStats"
NCU_GREP="joint_attention|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued"
ncu --clock-control none -k regex:joint_attention -c 2 $NCU_SECTIONS \
  python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels tf32x3,f32 > "$OUT/ncu.log" 2>&1
grep -E "$NCU_GREP" "$OUT/ncu.log"
ncu --clock-control none -k regex:joint_attention_wgmma -c 1 $NCU_SECTIONS --section ComputeWorkloadAnalysis \
  python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels wgmma --dtype bf16 > "$OUT/ncu_wgmma.log" 2>&1
grep -E "$NCU_GREP|Issue Slots Busy|Executed Ipc" "$OUT/ncu_wgmma.log"
ncu --clock-control none -k regex:joint_attention_fp8 -c 1 $NCU_SECTIONS --section ComputeWorkloadAnalysis \
  python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels fp8 --dtype bf16 > "$OUT/ncu_fp8.log" 2>&1
grep -E "$NCU_GREP|Issue Slots Busy|Executed Ipc" "$OUT/ncu_fp8.log"
ncu --clock-control none -k regex:joint_attention_mma16 -c 1 $NCU_SECTIONS \
  python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels mma16 --dtype bf16 > "$OUT/ncu_mma16.log" 2>&1
grep -E "$NCU_GREP" "$OUT/ncu_mma16.log"
stamp ncu done

python3 benchmarks/bench_overheads.py --json "$OUT/overheads_h200.json" | grep -E "dtype|_s\"|_us"
if [ -n "${AB_BASELINE:-}" ]; then
  echo "baseline ($AB_BASELINE) overheads:"
  (cd "$AB_BASELINE" && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/bench_overheads.py) | grep -E "dtype|_s\"|_us"
fi
stamp overheads done
fi
[ "$PART" = test ] && exit 0

if [ -n "${AB_BASELINE:-}" ]; then
  python3 benchmarks/bench_ab.py --baseline "$AB_BASELINE" --json "$OUT/ab_h200.json"
  stamp bench_ab done
fi
python3 benchmarks/bench_kernel.py ${1:+--shapes "$1"} ${BENCH_ROWS:+--rows "$BENCH_ROWS"} --json "$OUT/kernel_h200.json"
stamp bench_kernel done

python3 benchmarks/bench_model.py --models "${MODELS:-klein-4B,klein-9B,dev}" --sizes "${SIZES:-1024}" \
  --reps 3 --json "$OUT/model_h200.json"
stamp bench_model done

python3 benchmarks/bench_8bit_peer.py --json "$OUT/8bit_peer_h200.json"
stamp bench_8bit_peer done

python3 benchmarks/bench_model.py --models klein-4B --sizes "${SIZES:-1024}" --backends stock,pictor_bf16,pictor_fp8 \
  --compile --reps 3 --json "$OUT/model_compiled_h200.json"
stamp bench_model compiled done

for precision in fp32 bf16 fp8; do
  python3 examples/generate.py --tiny --compare --precision "$precision" --out "$OUT/generate_$precision/img.png" 2>&1 \
    | grep -E "RANDOM|PictorAttn|stock|yardstick"
done
stamp generate done
