#!/usr/bin/env bash
# One GPU session, ≤ 10 minutes, the open goals' measurements first: the CUDA tests, the batch sweep
# against Opacus (gpu_batch_sweep.py: the CNN and MLP, DP-SGD and OSO), K = 25 stacked CNN trials with a
# profile of where their time goes, MiniLM fine-tuning with CUDA graphs on and off, then in what time is
# left the galli-mnist gpu-slice from scratch (timed, the GPU's utilisation logged; resumable), one run's
# host syncs, the per-sample convolution benchmark and dptune against Opacus. Everything it prints or
# writes goes under $OUT (default runs/gpu-session).
#
#   DPTUNE_DATA_DIR=/path/to/data bash benchmarks/gpu_session.sh
#
# Each part has its own time limit (seconds; TESTS_S, SLICE_S, BENCH_S), so a slow part cannot
# starve the others; the slice is resumable (re-run the same command to finish it).
set -u
OUT=${OUT:-runs/gpu-session}
TESTS_S=${TESTS_S:-70}
SLICE_S=${SLICE_S:-490}
BENCH_S=${BENCH_S:-30}
SWEEP_S=${SWEEP_S:-150}
SWEEP_BATCHES=${SWEEP_BATCHES:-256 512 1024 2048 4096}
WORKERS=${WORKERS:-8}
PY=${PYTHON:-python3}
TOTAL_S=${TOTAL_S:-570}  # the whole script; the benchmarks run only in what is left
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T_START=$(date +%s)

set -o pipefail
{ echo "commit: $(git describe --always --dirty 2>/dev/null || echo 'unknown (no git here)')"
  git status --porcelain 2>/dev/null | head -n 20; } > "$OUT/version.txt"
if ! nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/tests.log"; then
  echo "nvidia-smi failed: this is not a GPU machine. Fix: run this script where a CUDA GPU is visible." >&2
  exit 3
fi
if ! "$PY" -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(0 if torch.cuda.is_available() else 1)" | tee -a "$OUT/tests.log"; then
  echo "PyTorch sees no CUDA device. Fix: install a CUDA build of torch." >&2
  exit 3
fi

timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider tests/gradients/test_cuda.py \
  "tests/privacy/test_edge_noise_tails.py::test_cuda_noise_law_determinism_and_tail" >> "$OUT/tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/tests.log"

left() { echo $(( TOTAL_S - ($(date +%s) - T_START) )); }
if [ "$(left)" -gt "$SWEEP_S" ]; then  # batch 256 … 4096 against Opacus; before/after with BASELINE_SRC=DIR/src
  timeout "$SWEEP_S" "$PY" benchmarks/gpu_batch_sweep.py --device cuda --batches $SWEEP_BATCHES \
    --child-seconds $(( SWEEP_S - 10 )) ${BASELINE_SRC:+--baseline-src "$BASELINE_SRC"} \
    --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?" >> "$OUT/sweep.log"
fi
if [ "$(left)" -gt 100 ]; then  # K = 25 stacked CNN trials against sequential runs, then a profile of one call
  timeout 90 "$PY" benchmarks/vectorized_trials.py --models galli_cnn --trials 25 --seq-trials 3 --batch 256 \
    --steps 60 --device cuda --profile --json "$OUT/stacked.json" > "$OUT/stacked.log" 2>&1
  echo "stacked rc=$?" >> "$OUT/stacked.log"
fi
if [ "$(left)" -gt 150 ]; then  # MiniLM full fine-tuning, batch 32: graphs forced (64 padded rows) and eager (the default)
  DPTUNE_GRAPH_MAX_PADDING=3 timeout 55 "$PY" benchmarks/hf_finetune.py --device cuda --rounds 5 --ops --no-opacus --json "$OUT/hf.json" > "$OUT/hf.log" 2>&1
  echo "hf rc=$?" >> "$OUT/hf.log"
  DPTUNE_CUDA_GRAPHS=0 timeout 55 "$PY" benchmarks/hf_finetune.py --device cuda --rounds 5 --ops --no-opacus \
    --json "$OUT/hf_eager.json" > "$OUT/hf_eager.log" 2>&1
  echo "hf eager rc=$?" >> "$OUT/hf_eager.log"
fi
if [ "$(left)" -gt 80 ]; then  # one run alone (dptune.train, Poisson batches): host syncs per step, GPU busy
  for m in galli_cnn mlp; do
    timeout 35 "$PY" benchmarks/host_syncs.py --device cuda --model "$m" --json "$OUT/syncs_$m.json" >> "$OUT/syncs.log" 2>&1
    echo "syncs $m rc=$?" >> "$OUT/syncs.log"
  done
fi
if [ "$(left)" -gt 60 ]; then  # the slice from scratch in what is left (re-run the same command to finish it)
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 20 > "$OUT/gpu_util.log" 2>&1 &
  UTIL_PID=$!
  rm -rf /tmp/gpu-slice-new
  t0=$(date +%s)
  timeout "$(( $(left) < SLICE_S ? $(left) - 20 : SLICE_S ))" "$PY" -m dptune reproduce galli-mnist --scale gpu-slice \
    --executor process --workers "$WORKERS" --out /tmp/gpu-slice-new --no-progress > "$OUT/slice.log" 2>&1
  echo "slice rc=$? wall_s=$(( $(date +%s) - t0 )) workers=$WORKERS" >> "$OUT/slice.log"
  kill "$UTIL_PID" 2>/dev/null
  "$PY" -m dptune status /tmp/gpu-slice-new/study >> "$OUT/slice.log" 2>&1
  "$PY" -c "import sqlite3; c = sqlite3.connect('/tmp/gpu-slice-new/study/study.sqlite')
for r in c.execute(\"select run_id, seconds, error from runs where error is not null\"): print(*r, sep='\n', end='\n\n')" \
    > "$OUT/slice_errors.txt" 2>&1  # a failed run's traceback comes back (the store can be over the size limit)
  tar czf "$OUT/slice.tgz" --exclude=checkpoints -C /tmp gpu-slice-new 2>/dev/null
fi
if [ "$(left)" -gt "$BENCH_S" ]; then
  timeout "$BENCH_S" "$PY" benchmarks/conv_per_sample.py --device cuda --json "$OUT/conv.json" > "$OUT/conv.log" 2>&1
  echo "conv rc=$?" >> "$OUT/conv.log"
fi
if [ "$(left)" -gt 30 ]; then  # dptune against Opacus on the same GPU, in what time is left
  timeout "$(left)" "$PY" benchmarks/step_throughput.py --device cuda --models galli_cnn mlp --quick \
    > "$OUT/throughput.log" 2>&1
  echo "throughput rc=$? limit_s=$(left)" >> "$OUT/throughput.log"
fi
tail -n 4 "$OUT"/*.log
