#!/usr/bin/env bash
# One device call for the 8-bit kernels ("fp8", "int8"): their GPU tests, compute-sanitizer memcheck and racecheck
# on both (odd shapes, key counts), bench_8bit_peer.py (speed by stage and accuracy against cuDNN and
# SageAttention), and interleaved A/Bs against baseline checkouts (AB: space-separated DIR=ROWS pairs, e.g.
# "AB=.ab/main=fp8:bf16 .ab/old=int8:bf16").
# Usage (repo root, device machine): BUDGET=560 [AB=...] bash benchmarks/run_8bit.sh [STEP...];
# steps: tests, memcheck, racecheck, peer, ab (default: all, in that order).
BUDGET=${BUDGET:-560}
source benchmarks/device_env.sh
for part in ${@:-tests memcheck racecheck peer ab}; do
  case $part in
    tests) step 200 python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_int8_pv.py \
        > "$OUT/pytest_8bit.log" 2>&1
      grep -E "^int8 N|passed|failed|^FAILED|^E  " "$OUT/pytest_8bit.log" | tail -30 ;;
    memcheck|racecheck) for kernel in int8 fp8; do   # one kernel a run: racecheck over both passes 100 s
        step 100 compute-sanitizer --tool "$part" --error-exitcode 9 python3 benchmarks/sanitizer_cases.py \
          --kernels "$kernel" --no-models > "$OUT/sanitize_${part}_$kernel.log" 2>&1
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|finite=False" "$OUT/sanitize_${part}_$kernel.log" | tail -3
      done ;;
    peer) step 200 python3 benchmarks/bench_8bit_peer.py --json "$OUT/${GPU}_8bit_peer.json" ;;
    ab) for pair in ${AB:-}; do
        step 100 python3 benchmarks/bench_ab.py --baseline "${pair%%=*}" --rows "${pair#*=}" \
          --shapes 1x24x4608x128,1x24x16896x128,2x2x300x129x128 --json "$OUT/${GPU}_ab_$(basename "${pair%%=*}").json"
      done ;;
    *) echo "unknown step $part"; exit 2 ;;
  esac
done
