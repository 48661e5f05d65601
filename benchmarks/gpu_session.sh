#!/usr/bin/env bash
# One GPU session, ≤ 10 minutes: the galli-mnist gpu-slice, the CUDA tests, and the GPU step
# throughput (dptune against Opacus) and vectorised-trials speed-up. Everything it prints or
# writes goes under $OUT (default runs/gpu-session).
#
#   DPTUNE_DATA_DIR=/path/to/data bash benchmarks/gpu_session.sh
#
# Each part has its own time limit (seconds; SLICE_S, TESTS_S, BENCH_S), so a slow part cannot
# starve the others; the slice is resumable (re-run the same command to finish it).
set -u
OUT=${OUT:-runs/gpu-session}
SLICE_S=${SLICE_S:-390}
TESTS_S=${TESTS_S:-80}
BENCH_S=${BENCH_S:-45}
WORKERS=${WORKERS:-8}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

set -o pipefail
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"; then
  echo "nvidia-smi failed: this is not a GPU machine. Fix: run this script where a CUDA GPU is visible." >&2
  exit 3
fi
if ! "$PY" -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "PyTorch sees no CUDA device. Fix: install a CUDA build of torch." >&2
  exit 3
fi

t0=$(date +%s)
timeout "$SLICE_S" "$PY" -m dptune reproduce galli-mnist --scale gpu-slice --executor process \
  --workers "$WORKERS" --out /tmp/gpu-slice --no-progress > "$OUT/slice.log" 2>&1
echo "slice rc=$? wall_s=$(( $(date +%s) - t0 ))" | tee -a "$OUT/slice.log"
"$PY" -m dptune status /tmp/gpu-slice/study >> "$OUT/slice.log" 2>&1
tar czf "$OUT/slice.tgz" --exclude=checkpoints -C /tmp gpu-slice 2>/dev/null

timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  "tests/test_edge_noise_tails.py::test_cuda_noise_law_determinism_and_tail" > "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"

timeout "$BENCH_S" "$PY" benchmarks/step_throughput.py --device cuda --models galli_cnn mlp --quick \
  > "$OUT/throughput.log" 2>&1
echo "throughput rc=$?" >> "$OUT/throughput.log"
timeout "$BENCH_S" "$PY" benchmarks/vectorized_trials.py --device cuda --quick > "$OUT/vectorized.log" 2>&1
echo "vectorized rc=$?" >> "$OUT/vectorized.log"
tail -n 3 "$OUT"/*.log
