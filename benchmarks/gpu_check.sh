#!/usr/bin/env bash
# The project's GPU checks in one command, on a CUDA machine that may have only torch, triton and
# transformers (no network):
#
#     bash benchmarks/gpu_check.sh [WHEEL_DIR]          # from the repository root, < 8 minutes
#
# WHEEL_DIR (or $NTIL_WHEELS): a folder of wheels for what that machine lacks (for its Python, e.g.
# cp312 / py3-none-any: pydantic, pyyaml, pytest, deepspeed, accelerate, liger-kernel, ...). They are
# installed with `pip install --no-index --find-links WHEEL_DIR --no-deps` into a scratch folder put first
# on PYTHONPATH (the machine's own packages are left alone). deepspeed has no wheel on PyPI:
# `DS_BUILD_OPS=0 pip wheel deepspeed --no-deps --no-build-isolation -w WHEEL_DIR` on any machine with
# torch makes a pure-Python one.
#
# Steps, each bounded by `timeout` (budget in seconds; 5 s more to kill), its output in OUT/STEP.log:
#   setup       30  install the wheels
#   gpu_tests   70  pytest -q tests/gpu
#   loss_table 100  python -m benchmarks.loss_speed --device cuda (the methods of $LOSS_METHODS)
#   head_table  55  python -m benchmarks.head_speed --device cuda
#   step_2b    170  python -m benchmarks.train_step --device cuda --model-size 2b: ours vs the HF Trainer
#                   (4 measured steps of 16 samples per job; needs deepspeed and accelerate)
# = 425 s, + 25 s to kill at most, + ~20 s of import probes: under 8 minutes. A step that cannot run here (no CUDA device, a
# package it needs is missing) is skipped with the reason; a step that fails or runs out of time makes
# the exit status 1. OUT: $OUT if set, else ./gpu_check_out; OUT/summary.txt has one line per step.
# Without CUDA (checked with nvidia-smi before anything imports torch) every GPU step is skipped and
# the script ends in a second or so: tests/unit/test_gpu_check.py runs it that way on CPU. A GPU that
# nvidia-smi lists but torch cannot use (a CPU build of torch, a broken wheel) fails every GPU step.
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${1:-${NTIL_WHEELS:-}}
LOSS_METHODS=${LOSS_METHODS:-cross_entropy,ntil,ntil_eager,liger}  # ntil_compiled/ntil_torch: minutes
# Both folders as absolute paths before the cd into the repository (they may be given relative to here).
mkdir -p "${OUT:-$PWD/gpu_check_out}" || exit 1
OUT_DIR=$(cd "${OUT:-$PWD/gpu_check_out}" && pwd)
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then WHEELS=$(cd "$WHEELS" && pwd); fi
SUMMARY=$OUT_DIR/summary.txt
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/ntil_gpu_check.XXXXXX")  # not under OUT: it is copied back
trap 'rm -rf "$SCRATCH"' EXIT  # also when interrupted
FAILED=0
cd "$REPO" || exit 1

export PYTHONPATH="$SCRATCH/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "# step	status	seconds	budget_s	detail"
} >"$SUMMARY"

record() {  # STEP STATUS SECONDS BUDGET DETAIL
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$SUMMARY"
}

skip() {  # STEP BUDGET REASON
  echo "SKIP $1: $3"
  record "$1" skipped 0 "$2" "$3"
}

run_step() {  # STEP BUDGET COMMAND...: output to the terminal and OUT/STEP.log
  local step=$1 budget=$2 started=$SECONDS rc status
  shift 2
  echo "== $step (budget ${budget} s): $*"
  timeout --kill-after=5 "$budget" "$@" 2>&1 | tee "$OUT_DIR/$step.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status="failed (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || FAILED=1
  echo "== $step: $status in $((SECONDS - started)) s"
  record "$step" "$status" "$((SECONDS - started))" "$budget" "log: $OUT_DIR/$step.log"
}

missing_modules() {  # MODULE...: prints those that do not import (empty: all do)
  "$PYTHON" - "$@" <<'PY'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as error:  # an ImportError, or a package that breaks on import here
        missing.append(f"{name} ({type(error).__name__}: {error})")
print("; ".join(missing))
PY
}

# setup: the carried wheels
if [ -z "$WHEELS" ]; then
  skip setup 30 "no wheel folder given (argument 1 or NTIL_WHEELS): using the installed packages"
elif ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "error: no *.whl in the wheel folder $WHEELS" >&2
  record setup "failed (no wheels)" 0 30 "$WHEELS"
  exit 1
else
  run_step setup 30 "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps \
    --no-compile --target "$SCRATCH/site" "$WHEELS"/*.whl
  # what is now first on PYTHONPATH, for the record
  find "$SCRATCH/site" -maxdepth 1 -name '*.dist-info' -printf '%f\n' 2>/dev/null | sort >"$OUT_DIR/installed.txt"
fi

# CUDA: nvidia-smi first, so a machine without a GPU skips everything without importing torch. A GPU
# that torch cannot use (a CPU build of torch, a broken carried wheel) is a failure, not a skip: the
# check would otherwise pass having run nothing.
cuda_reason=""
cuda_status=skipped
if ! command -v nvidia-smi >/dev/null 2>&1; then
  cuda_reason="no CUDA device (nvidia-smi not found)"
elif ! nvidia-smi -L >/dev/null 2>&1; then
  cuda_reason="no CUDA device (nvidia-smi -L failed)"
elif ! probe=$("$PYTHON" -c "import torch, transformers
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False (a CPU build of torch?)'
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" 2>&1); then
  cuda_reason="nvidia-smi lists a GPU but torch cannot use it: ${probe##*$'\n'}"  # the error's last line
  cuda_status=failed
  FAILED=1
fi

if [ -n "$cuda_reason" ]; then
  for step in gpu_tests:70 loss_table:100 head_table:55 step_2b:170; do
    if [ "$cuda_status" = failed ]; then
      echo "FAILED ${step%%:*}: $cuda_reason"
      record "${step%%:*}" failed 0 "${step##*:}" "$cuda_reason"
    else
      skip "${step%%:*}" "${step##*:}" "$cuda_reason"
    fi
  done
else
  { nvidia-smi -L; echo "$probe"; } | tee "$OUT_DIR/device.txt"

  missing=$(missing_modules pytest)
  if [ -n "$missing" ]; then
    skip gpu_tests 70 "missing: $missing"
  else
    run_step gpu_tests 70 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
  fi

  run_step loss_table 100 "$PYTHON" -m benchmarks.loss_speed --device cuda --methods "$LOSS_METHODS"
  run_step head_table 55 "$PYTHON" -m benchmarks.head_speed --device cuda --json "$OUT_DIR/head_speed.json"

  # ours (DeepSpeed ZeRO-3) and the HF Trainer (on the same DeepSpeed JSON, through accelerate)
  missing=$(missing_modules deepspeed accelerate)
  if [ -n "$missing" ]; then
    skip step_2b 170 "missing: $missing"
  else
    # 4 measured steps of 16 clock samples (~5k tokens) per job, after 1 warm-up: the 2B model builds in
    # ~20 s and its first step takes ~17 s, so each of the two jobs fits in about a minute
    run_step step_2b 170 "$PYTHON" -m benchmarks.train_step --device cuda --model-size 2b \
      --steps 5 --warmup 1 --samples 320 --workdir "$SCRATCH/train_step" train.global_batch_size=16
    cp "$SCRATCH/train_step/results.json" "$OUT_DIR/step_2b_results.json" 2>/dev/null
    for log in "$SCRATCH"/train_step/round*/job.log; do
      [ -f "$log" ] && cp "$log" "$OUT_DIR/step_2b_$(basename "$(dirname "$log")").log"
    done
  fi
fi

echo "# total $SECONDS s" >>"$SUMMARY"
echo
echo "summary ($SUMMARY):"
cat "$SUMMARY"
exit "$FAILED"
