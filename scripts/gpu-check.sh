#!/usr/bin/env bash
# The GPU check of issue 44, in one run of 10 minutes or less on one H100/H200 with no network, on the
# half-width DeepSeek-V2-Lite checkpoint (14.4 GB of experts), 32 new tokens, routing replayed from a trace:
#   1. the CUDA tests (the test files with torch.cuda.is_available() skips), while
#   2. the checkpoint is written to local disk by `make-model` (kept for a rerun on the same machine);
#   3. `profile`: the pinned host -> device GB/s of one expert, and all resident, per decode step, the
#      device-to-host reads the engine counts, the host syncs and D2H copies torch.profiler sees, and the
#      top Python functions (scripts/gpu_profile.py; 3 warm-up steps dropped);
#   4. `host-25`: a 25% device budget with a warm host tier holding every expert (`--host-budget 1.0`):
#      sync LRU, async LRU and `default`, beside all resident and plain transformers (its steady TPOT
#      with 3 warm-up steps dropped, and whether its tokens equal moestream's);
#   5. `host-compute-25` (issue 48): the same 25% with the same warm host tier, a device-tier miss held in the
#      host tier computed on the host by each rule: off, a fixed share (share:0.5) and `default`; async LRU and
#      `default` once per rule (sync LRU: off), each run's share of misses computed on the host, the bytes
#      copied up and the host compute lane per token (GPU_CHECK_HOST_THREADS host threads);
#   6. `disk-25`: 25% from disk, no host tier: sync LRU, async LRU and `default`;
#   7. `nomanifest-25`: the same without the integrity manifest (a copy of the checkpoint's folder whose
#      shards are links), sync and async LRU: what the digest check costs each;
#   8. (optional steps: `quant`, int4 experts against bf16 at one byte budget; `ep`, expert parallelism)
#   9. a table of every run, and one archive of everything: $OUT.tar.gz.
# Each step prints its results as it ends and runs under its own timeout (capped by what is left of
# GPU_CHECK_BUDGET_S), so one failure or overrun loses only that step. Everything goes to $OUT:
# <step>.log (env.log: machine and versions), steps.tsv (step, exit status, seconds), tests.xml,
# profile.json, bench-engine-*.json, table.md; then $OUT.tar.gz holds them all.
#
# Run from the repository root (moestream need not be installed: PYTHONPATH is set to it):
#   scripts/gpu-check.sh
# Smoke mode, on a machine without a GPU (CPU, a tiny checkpoint of the same topology):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_PRESET=small GPU_CHECK_TOKENS=6 \
#     GPU_CHECK_TRACE=../shared/data/routing/deepseek-v2-lite/puffin_dev.npz scripts/gpu-check.sh
#
# Variables (defaults):
#   OUT                 ./gpu-check-out
#   GPU_CHECK_DEVICE    cuda          (cpu in smoke mode)
#   GPU_CHECK_PRESET    half          (full: DeepSeek-V2-Lite, half: --width-scale 0.5, small: tiny widths)
#   GPU_CHECK_TRACE     .gpu-data/puffin_dev.npz  (DeepSeek-V2-Lite routing; without it the model routes)
#   GPU_CHECK_PREDICTOR .gpu-data/predictor-default  (`default`'s trained predictor: train-predictor
#                       --kind default on the trace; where absent, one is trained here in 2 epochs)
#   GPU_CHECK_CKPT      /tmp/moestream-gpu-check/<preset>
#   GPU_CHECK_TOKENS    32            (new tokens per prompt)
#   GPU_CHECK_PROMPTS   1             (demo prompts per run)
#   GPU_CHECK_BUDGET_S  570           (all steps together; the table and the archive are written after it)
#   GPU_CHECK_HOST_THREADS 4          (host-compute-25's --host-threads; at most the machine's cores)
#   GPU_CHECK_PYTHON    python3
#   GPU_CHECK_STEPS     "tests profile host-25 host-compute-25 disk-25 nomanifest-25" (which optional steps
#                       run, in this order; also `quant` and `ep`; env, table and the archive always run, make-model and
#                       train-predictor where a step needs the checkpoint)
# Carry the folder .gpu-data (ignored by git): puffin_dev.npz (the trace), predictor-default
# (train-predictor --kind default --trace puffin_dev.npz) and, where the machine's python3 has no
# pytest, pylib (pip install --target .gpu-data/pylib pytest, on a machine with a network).
set -u -o pipefail

OUT=${OUT:-./gpu-check-out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PRESET=${GPU_CHECK_PRESET:-half}
TRACE=${GPU_CHECK_TRACE:-.gpu-data/puffin_dev.npz}
PREDICTOR=${GPU_CHECK_PREDICTOR:-.gpu-data/predictor-default}
CKPT=${GPU_CHECK_CKPT:-/tmp/moestream-gpu-check/$PRESET}
TOKENS=${GPU_CHECK_TOKENS:-32}
PROMPTS=${GPU_CHECK_PROMPTS:-1}
PY=${GPU_CHECK_PYTHON:-python3}
STEPS=" ${GPU_CHECK_STEPS:-tests profile host-25 host-compute-25 disk-25 nomanifest-25} "
HOST_THREADS=${GPU_CHECK_HOST_THREADS:-4}
HOST_THREADS=$((HOST_THREADS < $(nproc) ? HOST_THREADS : $(nproc)))
HOST_RULES=off,share:0.5,default  # host-compute-25's --host-compute rules
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-570}))
CUDA_TESTS=(tests/store/test_store.py tests/store/test_pool.py tests/store/test_stream_order.py
            tests/checkpoint/test_manifest.py tests/runtime/test_config.py tests/store/test_config.py
            tests/runtime/test_host_reads.py tests/bench/engine/test_cuda.py)

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

predictor_flags() {  # the trace and `default`'s predictor, where there are
  if [ -f "$TRACE" ]; then printf '%s\n' --replay-routing "$TRACE"; else echo "no trace at $TRACE: the model routes" >&2; fi
  [ "${OUT_PREDICTOR:-}" = none ] && return 0  # `default` is left out (it fails at once, saying so)
  for dir in "$PREDICTOR" "$OUT/predictor-default"; do
    if [ -d "$dir" ]; then printf '%s\n' --predictor-dir "$dir"; break; fi
  done
}

bench() {  # bench LABEL CHECKPOINT BUDGETS [FLAGS...]: bench engine, 3 warm-up steps out of the steady TPOT
  local label=$1 ckpt=$2 budgets=$3 extra
  shift 3
  mapfile -t extra < <(predictor_flags)
  "$PY" -m moestream bench engine --model "$ckpt" --device "$DEVICE" --budgets "$budgets" --designs '' --no-hf \
    --prompts "$PROMPTS" --max-new-tokens "$TOKENS" --warmup-steps 3 "${extra[@]}" "$@" \
    --json "$OUT/bench-engine-$label.json"
}

profile() {
  local extra=()
  if [ -f "$TRACE" ]; then extra+=(--replay-routing "$TRACE"); fi
  "$PY" scripts/gpu_profile.py --model "$CKPT" --device "$DEVICE" --steps "$TOKENS" --warmup 3 "${extra[@]}" \
    --json "$OUT/profile.json"
}

without_manifest() {  # the checkpoint's folder again, its files linked, without moestream-manifest.json
  local copy="$CKPT-nomanifest"
  rm -rf "$copy" && mkdir -p "$copy" || return 1
  for file in "$CKPT"/*; do
    [ "$(basename "$file")" = moestream-manifest.json ] || ln -s "$file" "$copy/"
  done
  PREDICTOR=/nonexistent OUT_PREDICTOR=none bench nomanifest-25 "$copy" 0.25 --no-transformers  # LRU only
}

quant() {  # an int4 copy of the checkpoint (kept for a rerun), then both at one byte budget
  if [ ! -f "$CKPT-int4/moestream-manifest.json" ]; then
    rm -rf "$CKPT-int4" && "$PY" -m moestream quantize --model "$CKPT" --format int4 --out "$CKPT-int4" --no-error \
      --workers "$(nproc)" || return 1
  fi
  local extra
  mapfile -t extra < <(predictor_flags)
  "$PY" -m moestream bench quant --models "$CKPT,$CKPT-int4" --device "$DEVICE" --budget 0.25 --prompts "$PROMPTS" \
    --max-new-tokens "$TOKENS" "${extra[@]}" --json "$OUT/bench-quant.json"
}

wanted() { [[ $STEPS == *" $1 "* ]]; }
needs_checkpoint() {
  wanted profile || wanted host-25 || wanted host-compute-25 || wanted disk-25 || wanted nomanifest-25 || wanted quant
}

export OUT DEVICE PRESET TRACE PREDICTOR CKPT TOKENS PROMPTS PY MAKE_ARGS
export -f environment make_checkpoint train_predictor predictor_flags bench profile without_manifest quant
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
    profile) step profile 100 bash -c profile ;;
    host-25) step host-25 170 bash -c "bench host-25 '$CKPT' 0.25 --host-budget 1.0" ;;
    host-compute-25) step host-compute-25 240 bash -c "bench host-compute-25 '$CKPT' 0.25 --host-budget 1.0 \
      --no-transformers --host-compute $HOST_RULES --host-threads $HOST_THREADS" ;;
    disk-25) step disk-25 170 bash -c "bench disk-25 '$CKPT' 0.25 --no-transformers" ;;
    nomanifest-25) step nomanifest-25 100 bash -c without_manifest ;;
    quant) step quant 300 bash -c quant ;;
    *) echo "gpu-check: unknown step '$name' in GPU_CHECK_STEPS" >&2 ;;
  esac
done
DEADLINE=$((SECONDS + 30))
step table 20 "$PY" scripts/gpu_check_table.py "$OUT" --out "$OUT/table.md"
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "gpu-check: archive $OUT.tar.gz"
echo "gpu-check: finished in $SECONDS s; results in $OUT"
