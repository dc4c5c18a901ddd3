#!/usr/bin/env bash
# One device call of checks after a change to kernels or the host path: the GPU test suite, compute-sanitizer
# memcheck and racecheck on every kernel (the tiny FLUX.2 forwards included), the host profile and overheads, and
# ncu's shared-memory and tensor-pipe figures of the fp16x3 kernel (is its S product bound by shared memory?).
# Usage (repo root, device machine): BUDGET=400 bash benchmarks/run_checks.sh [STEP...]; steps: suite, memcheck,
# racecheck, host, overheads, ncu_fp16x3 (default: all but ncu_fp16x3, in that order). Each step runs under the
# smaller of its limit and the time left. SANITIZE_ARGS: arguments of sanitizer_cases.py (e.g. --kernels fp16x3).
BUDGET=${BUDGET:-400}
source benchmarks/device_env.sh
sanitize() {
  step 100 compute-sanitizer --tool "$1" --error-exitcode 9 python3 benchmarks/sanitizer_cases.py ${SANITIZE_ARGS:-} \
    > "$OUT/sanitize_$1.log" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|finite=False|rc=" "$OUT/sanitize_$1.log" | tail -3
}
for name in "${@:-suite memcheck racecheck host overheads}"; do
  for part in $name; do
    case $part in
      suite) step 230 python3 -m pytest -q -rs -m gpu --maxfail=30 -p no:cacheprovider tests > "$OUT/pytest_gpu.log" 2>&1
        grep -E "passed|failed|^FAILED|^ERROR|^E  " "$OUT/pytest_gpu.log" | tail -25 ;;
      memcheck|racecheck) sanitize "$part" ;;
      host) step 60 python3 benchmarks/profile_host.py --json "$OUT/${GPU}_host_profile.json" | grep "µs host" ;;
      overheads) step 90 python3 benchmarks/bench_overheads.py --json "$OUT/${GPU}_overheads.json" | grep -E "dtype|_us" ;;
      ncu_fp16x3) step 120 ncu --clock-control none -k regex:joint_attention_fp16x3 -c 1 --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats \
          python3 benchmarks/sanitizer_cases.py --shape 1x24x4608x128 --kernels fp16x3 > "$OUT/${GPU}_ncu_fp16x3.log" 2>&1
        grep -E "Duration|Throughput|Shared|Pipe|Tensor|Stall|Issue" "$OUT/${GPU}_ncu_fp16x3.log" | head -40 ;;
      *) echo "unknown step $part"; exit 2 ;;
    esac
  done
done
