#!/usr/bin/env bash
# One device call for the stack records (issue 29): fp8-linear GPU tests, then bench_stack steps, each under a
# timeout cut to the time left. Usage (repo root, device machine): BUDGET=580 bash benchmarks/run_stack.sh STEP...
# Steps: tests (the fp8-linear GPU tests), regional:<image> (all six configs, repeated blocks compiled),
# whole:<image>[:<linears>] (the whole model compiled), probe (a 1+2-block fp8 model compiled whole, torchao's
# inductor options off then on: compile seconds), parity:<image> (stock and PictorAttn(), regional), suite (the
# GPU test suite), host (profile_host.py), layers (LAYERS: a comma list of its rows), auto_route, kernel (the
# bf16 kernel against cuDNN at issue 29's shapes), peer8 (bench_8bit_peer.py).
BUDGET=${BUDGET:-580}
source benchmarks/device_env.sh
stack() { (cd benchmarks && step "$@"); }
for spec in "$@"; do
  IFS=: read -r name image linears <<< "$spec"
  case $name in
    tests) step 150 python3 -m pytest -q -x -rs tests/test_gpu_fp8_linears.py 2>&1 | tail -5 ;;
    suite) step 400 python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|^E  " | tail -20 ;;
    regional) stack 330 python3 bench_stack.py --image "$image" --regional --stacks 240 \
      --json "$OUT/${GPU}_stack_${image}_regional.json" ;;
    parity) stack 150 python3 bench_stack.py --image "$image" --regional --backends stock,pictor_fp32 --linears bf16 \
      --json "$OUT/${GPU}_stack_${image}_parity.json" ;;
    whole) stack 400 python3 bench_stack.py --image "$image" --linears "${linears:-bf16,fp8}" --stacks 240 \
      --json "$OUT/${GPU}_stack_${image}_whole_${linears:-all}.json" ;;
    probe)
      stack 120 python3 bench_stack.py --blocks 1,2 --linears fp8 --backends stock --reps 3 --stacks 100 \
        --json "$OUT/${GPU}_stack_probe_default.json"
      stack 150 python3 bench_stack.py --blocks 1,2 --linears fp8 --backends stock --reps 3 --tune-inductor \
        --stacks 140 --json "$OUT/${GPU}_stack_probe_tuned.json" ;;
    host) step 120 python3 benchmarks/profile_host.py --json "$OUT/${GPU}_host_profile.json" ;;
    layers) step 240 python3 benchmarks/bench_layers.py ${LAYERS:+--layers "$LAYERS"} --json "$OUT/${GPU}_layers.json" ;;
    kernel) step 150 python3 benchmarks/bench_kernel.py --rows pictor_wgmma:bf16,sdpa_cudnn:bf16 \
      --shapes 1x24x4608x128,1x24x16896x128,2x32x8704x128,1x40x32760x128,2x24x4437x64 \
      --json "$OUT/${GPU}_kernel_vs_cudnn.json" ;;
    peer8) step 200 python3 benchmarks/bench_8bit_peer.py --json "$OUT/${GPU}_8bit_peer.json" ;;
    auto_route) step 120 python3 benchmarks/bench_auto_route.py --json "$OUT/${GPU}_auto_route.json" ;;
    *) echo "unknown step $spec"; exit 2 ;;
  esac
done
