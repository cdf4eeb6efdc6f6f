#!/usr/bin/env bash
# The GPU check of issue 34, in one run of under 8 minutes on one GPU with no network:
#   1. the CUDA tests (the test files with torch.cuda.is_available() skips), while
#   2. a full-shape DeepSeek-V2-Lite checkpoint (31 GB) is written to local disk by `make-model`
#      (kept for a rerun on the same machine: an existing one with its manifest is reused);
#   3. `bench engine --device cuda` (on-demand LRU, async LRU, `default`), cold, with routing replayed
#      from a trace: at 25%, then 50%, then 10% (each call also runs all experts resident);
#   4. int4 experts: `quantize --format int4` of that checkpoint, then `bench quant --device cuda` of
#      the two at one byte budget (25% of the bf16 experts' bytes), `default` and on-demand LRU;
#   5. (optional step `ep`, not in the default steps) expert parallelism on CUDA: generate under torchrun
#      with one rank (NCCL) and two ranks sharing the GPU (gloo), tokens against one process
#      (tests/parallel/test_nccl.py, about a minute; $OUT/ep.log, ep.xml);
#   6. a table of every run.
# Each step runs under its own timeout (capped by what is left of GPU_CHECK_BUDGET_S), so one failure
# or overrun loses only that step; a budget's figures come with its own call, so a late timeout loses
# only the last budget. Everything goes to $OUT: <step>.log (env.log: machine and versions), steps.tsv (step,
# exit status, seconds), tests.xml, bench-engine-*.json, table.md.
#
# Run from the repository root (moestream need not be installed: PYTHONPATH is set to it):
#   scripts/gpu-check.sh
# Smoke mode, on a machine without a GPU (CPU, a tiny checkpoint of the same topology):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PRESET=small \
#     GPU_CHECK_TRACE=../shared/data/routing/deepseek-v2-lite/puffin_dev.npz scripts/gpu-check.sh
#
# Variables (defaults):
#   OUT                 ./gpu-check-out
#   GPU_CHECK_DEVICE    cuda          (cpu in smoke mode)
#   GPU_CHECK_PRESET    full          (full: DeepSeek-V2-Lite, half: --width-scale 0.5, small: tiny widths)
#   GPU_CHECK_TRACE     .gpu-data/puffin_dev.npz  (DeepSeek-V2-Lite routing; without it the model routes)
#   GPU_CHECK_PREDICTOR .gpu-data/predictor-default  (`default`'s trained predictor: train-predictor
#                       --kind default on the trace; where absent, one is trained here in 2 epochs)
#   GPU_CHECK_CKPT      /tmp/moestream-gpu-check/<preset>
#   GPU_CHECK_TOKENS    6             (new tokens per prompt)
#   GPU_CHECK_PROMPTS   1             (demo prompts per run)
#   GPU_CHECK_BUDGET_S  450           (all steps together; the table is written after it)
#   GPU_CHECK_PYTHON    python3
#   GPU_CHECK_STEPS     "tests bench-25 bench-50 bench-10 quant" (which optional steps run, the benches
#                       in this order; also `ep`; env and table always run, make-model and train-predictor
#                       where a bench or quant step is wanted: GPU_CHECK_STEPS=ep runs only the ep check)
# Carry the folder .gpu-data (ignored by git): puffin_dev.npz (the trace), predictor-default
# (train-predictor --kind default --trace puffin_dev.npz) and, where the machine's python3 has no
# pytest, pylib (pip install --target .gpu-data/pylib pytest, on a machine with a network).
set -u -o pipefail

OUT=${OUT:-./gpu-check-out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRESET=${GPU_CHECK_PRESET:-full}
TRACE=${GPU_CHECK_TRACE:-.gpu-data/puffin_dev.npz}
PREDICTOR=${GPU_CHECK_PREDICTOR:-.gpu-data/predictor-default}
CKPT=${GPU_CHECK_CKPT:-/tmp/moestream-gpu-check/$PRESET}
TOKENS=${GPU_CHECK_TOKENS:-6}
PROMPTS=${GPU_CHECK_PROMPTS:-1}
PY=${GPU_CHECK_PYTHON:-python3}
STEPS=" ${GPU_CHECK_STEPS:-tests bench-25 bench-50 bench-10 quant} "
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-450}))
CUDA_TESTS=(tests/store/test_store.py tests/store/test_pool.py tests/checkpoint/test_manifest.py
            tests/runtime/test_config.py tests/store/test_config.py tests/bench/engine/test_cuda.py)

case $PRESET in
  full) MAKE_ARGS="--preset deepseek-v2-lite" ;;
  half) MAKE_ARGS="--preset deepseek-v2-lite --width-scale 0.5" ;;
  small) MAKE_ARGS="--preset deepseek-v2-lite --width-scale 0.03125 --intermediate-size 32" ;;
  *) echo "gpu-check: GPU_CHECK_PRESET must be full, half or small, not '$PRESET'" >&2; exit 2 ;;
esac

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d .gpu-data/pylib ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu-data/pylib"
fi
printf 'step\texit\tseconds\n' > "$OUT/steps.tsv"

# step NAME MAX_S COMMAND...: COMMAND under a timeout of MAX_S (or what is left), logged to $OUT/NAME.log
step() {
  local name=$1 max=$2 left=$((DEADLINE - SECONDS)) start=$SECONDS rc
  shift 2
  local limit=$((max < left ? max : left))
  if ((limit < 15)); then
    printf '%s\tskipped\t0\n' "$name" | tee -a "$OUT/steps.tsv"
    return 124
  fi
  echo "== $name (timeout ${limit}s): $*"
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$OUT/steps.tsv"
  return "$rc"
}

environment() {
  date -u
  git log -1 --oneline 2>/dev/null
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  nproc; free -g; df -hT "$(dirname "$CKPT")" 2>/dev/null || df -hT /tmp
  "$PY" -c "import sys, torch, transformers, safetensors; print(sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'safetensors', safetensors.__version__)"
  "$PY" -c "import pytest; print('pytest', pytest.__version__)" 2>&1 | tail -1
  echo "device $DEVICE, preset $PRESET, checkpoint $CKPT, trace $TRACE, $PROMPTS prompt(s) x $TOKENS tokens"
}

make_checkpoint() {
  if [ -f "$CKPT/moestream-manifest.json" ]; then
    echo "reusing the checkpoint at $CKPT"
    return 0
  fi
  # a write killed by its timeout leaves its staging directory (.NAME.partial-*) beside the checkpoint
  rm -rf "$CKPT" "$(dirname "$CKPT")/.$(basename "$CKPT").partial-"* && mkdir -p "$(dirname "$CKPT")" || return 1
  df -h "$(dirname "$CKPT")" | tail -1
  # shellcheck disable=SC2086  # MAKE_ARGS: flags without spaces
  "$PY" -m moestream make-model $MAKE_ARGS --out "$CKPT" && sync
}

train_predictor() {
  if [ -d "$PREDICTOR" ]; then echo "using the predictor in $PREDICTOR"; return 0; fi
  if [ ! -f "$TRACE" ]; then echo "no trace at $TRACE: no predictor, default is skipped"; return 1; fi
  "$PY" -m moestream train-predictor --kind default --trace "$TRACE" --out "$OUT/predictor-default" --epochs 2 \
    --threads "$(nproc)" --no-progress
}

bench() {  # bench LABEL BUDGETS
  local extra=()
  if [ -f "$TRACE" ]; then extra+=(--replay-routing "$TRACE"); else echo "no trace at $TRACE: the model routes"; fi
  for dir in "$PREDICTOR" "$OUT/predictor-default"; do
    if [ -d "$dir" ]; then extra+=(--predictor-dir "$dir"); break; fi
  done
  "$PY" -m moestream bench engine --model "$CKPT" --device "$DEVICE" --budgets "$2" --designs '' --no-hf \
    --prompts "$PROMPTS" --max-new-tokens "$TOKENS" "${extra[@]}" --json "$OUT/bench-engine-$1.json"
}

quant() {  # an int4 copy of the checkpoint (kept for a rerun), then both at one byte budget
  if [ ! -f "$CKPT-int4/moestream-manifest.json" ]; then
    rm -rf "$CKPT-int4" && "$PY" -m moestream quantize --model "$CKPT" --format int4 --out "$CKPT-int4" --no-error \
      --workers "$(nproc)" || return 1
  fi
  local extra=()
  if [ -f "$TRACE" ]; then extra+=(--replay-routing "$TRACE"); fi
  for dir in "$PREDICTOR" "$OUT/predictor-default"; do
    if [ -d "$dir" ]; then extra+=(--predictor-dir "$dir"); break; fi
  done
  "$PY" -m moestream bench quant --models "$CKPT,$CKPT-int4" --device "$DEVICE" --budget 0.25 --prompts "$PROMPTS" \
    --max-new-tokens "$TOKENS" "${extra[@]}" --json "$OUT/bench-quant.json"
}

wanted() { [[ $STEPS == *" $1 "* ]]; }
needs_checkpoint() { wanted bench-25 || wanted bench-50 || wanted bench-10 || wanted quant; }

export OUT DEVICE PRESET TRACE PREDICTOR CKPT TOKENS PROMPTS PY MAKE_ARGS
export -f environment make_checkpoint train_predictor bench quant
step env 30 bash -c environment
WRITER=
if needs_checkpoint; then
  step make-model 200 bash -c make_checkpoint &
  WRITER=$!
fi
wanted tests && step tests 120 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/tests.xml" "${CUDA_TESTS[@]}"
wanted ep && step ep 150 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml "$OUT/ep.xml" tests/parallel/test_nccl.py
[ -n "$WRITER" ] && wait "$WRITER"
needs_checkpoint && step train-predictor 90 bash -c train_predictor
for name in $STEPS; do
  case $name in
    tests|ep) ;;  # run beside make-model, above
    bench-25) step bench-25 320 bash -c "bench 25 0.25" ;;  # a run of the 31 GB checkpoint takes 30-60 s
    bench-50) step bench-50 150 bash -c "bench 50 0.5" ;;
    bench-10) step bench-10 150 bash -c "bench 10 0.1" ;;
    quant) step quant 300 bash -c quant ;;
    *) echo "gpu-check: unknown step '$name' in GPU_CHECK_STEPS" >&2 ;;
  esac
done
DEADLINE=$((SECONDS + 30))
step table 20 "$PY" scripts/gpu_check_table.py "$OUT" --out "$OUT/table.md"
echo "gpu-check: finished in $SECONDS s; results in $OUT"
