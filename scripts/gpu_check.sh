#!/usr/bin/env bash
# The one-shot GPU check (issue 28): on a bare GPU machine (Python 3.12, CUDA torch, nvcc, ninja,
# no package registry), install the carried wheels and radixlm, then run every phase of
# scripts/gpu_check_phases.py under its own deadline. Under 8 minutes in all.
#
#   scripts/gpu_check.sh RESULTS_DIR [WHEEL_DIR]   # WHEEL_DIR defaults to .gpu_wheels
#   scripts/gpu_check.sh --dry-run [WHEEL_DIR]     # on CPU: script parses, phases and wheel list complete
#
# RESULTS_DIR gets results.txt (one line per phase: NAME PASS|FAIL|SKIP|TIMEOUT seconds detail),
# env.txt (versions, GPU), install.log and one NAME.log per phase. Exit 0 when nothing failed.
# Download the wheels beforehand: README "GPU check" (the command is in scripts/gpu_check_wheels.txt).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--dry-run" ]; then
    bash -n "$0" || { echo "FAIL: $0 does not parse"; exit 1; }
    echo "[PASS] $0 parses"
    exec "$PY" scripts/gpu_check_wheels.py "${2:-.gpu_wheels}"
fi
[ $# -ge 1 ] || { echo "usage: $0 RESULTS_DIR [WHEEL_DIR] | --dry-run [WHEEL_DIR]"; exit 2; }
OUT=$1
WHEELS=${2:-.gpu_wheels}
mkdir -p "$OUT"
: > "$OUT/results.txt"
export RADIXLM_DISABLE_CPU_KERNELS=1          # no CPU C++ extension builds on the GPU machine
export FLASHINFER_WORKSPACE_BASE="$OUT/flashinfer-cache"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

start=$(date +%s)
{
    date -u; "$PY" --version; command -v nvcc ninja; nvcc --version | tail -1; nvidia-smi -L
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
# The carried wheels, skipping what the machine already has (names unpinned: installed ones stay).
names=$(grep -v '^#' scripts/gpu_check_wheels.txt | sed 's/==.*//' | tr '\n' ' ')
if "$PY" -m pip install --no-index --no-deps --find-links "$WHEELS" $names > "$OUT/install.log" 2>&1 \
    && "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
    && "$PY" -c "import radixlm.runtime.server_args, flashinfer, zmq, fastapi, uvicorn, orjson, outlines_core" \
        >> "$OUT/install.log" 2>&1; then
    echo "install PASS $(( $(date +%s) - start ))s wheels from $WHEELS and radixlm (--no-deps)" >> "$OUT/results.txt"
else
    echo "install FAIL $(( $(date +%s) - start ))s see install.log: $(tail -1 "$OUT/install.log")" >> "$OUT/results.txt"
    cat "$OUT/results.txt"; exit 1
fi
"$PY" -m pip list 2>/dev/null | grep -i -E "flashinfer|tvm|torch|transformers" >> "$OUT/env.txt"

failed=0
while read -r name deadline; do
    t0=$(date +%s)
    timeout --kill-after=10 "$deadline" "$PY" scripts/gpu_check_phases.py --phase "$name" --results "$OUT" \
        > "$OUT/$name.log" 2>&1
    rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "$name TIMEOUT $(( $(date +%s) - t0 ))s deadline ${deadline}s: $(tail -1 "$OUT/$name.log")" >> "$OUT/results.txt"
        failed=1
    elif [ $rc -ne 0 ]; then
        grep -q "^$name " "$OUT/results.txt" || echo "$name FAIL $(( $(date +%s) - t0 ))s rc=$rc: $(tail -1 "$OUT/$name.log")" >> "$OUT/results.txt"
        failed=1
    fi
done < <("$PY" scripts/gpu_check_phases.py --list)
echo "total $(( $(date +%s) - start ))s" >> "$OUT/results.txt"
cat "$OUT/results.txt"
exit $failed
