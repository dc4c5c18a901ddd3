# Sourced by the device-call scripts (run_checks.sh, run_stack.sh) from the repo root on the GPU machine: installs
# the device wheels (.whl/) into /tmp/site, sets PYTHONPATH, $OUT, $GPU (e.g. "h100"), starts the clock, and
# defines `step LIMIT COMMAND...`, which runs COMMAND under the smaller of LIMIT and the time left of $BUDGET
# seconds (skipping it with under 20 s left).
set -u -o pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z_' | sed 's/nvidia_//; s/_.*//')
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
SECONDS=0
step() {
  local limit=$1 left=$(( BUDGET - SECONDS )); shift
  [ "$left" -lt 20 ] && { echo "[$SECONDS s] skipped (no time): $*"; return; }
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -s INT -k 10 "$limit" "$@"
  echo "[$SECONDS s] rc=$? $*"
}
