#!/usr/bin/env bash
# The project's GPU checks in one device command of <= 540 s (the machine's start outside it), on a CUDA
# machine that may have only torch, triton and transformers (no network):
#
#     bash benchmarks/gpu_check.sh [WHEEL_DIR]             # from the repository root
#     bash benchmarks/gpu_check.sh --dry-run [WHEEL_DIR]   # any machine, ~15 s: the plan, nothing on a GPU
#
# On a GPU runner that collects only its $OUT, leave OUT as the runner sets it (do not pass OUT=...):
# the outputs go to $OUT when it is set, else ./gpu_check_out.
#
# WHEEL_DIR (or $NTIL_WHEELS): wheels for what the machine lacks, as listed in benchmarks/gpu_wheels.txt
# (tests/unit/test_gpu_wheels.py keeps that list equal to what the GPU steps import). Each listed name
# that has a wheel there is installed by name, `pip install --no-index --find-links WHEEL_DIR --no-deps
# --target SCRATCH/site NAME`, so pip picks the wheel for this machine's Python; a name that fails is
# reported in OUT/wheels.tsv and the rest are installed. SCRATCH/site goes first on PYTHONPATH (the
# machine's own packages are left alone). deepspeed has no wheel on the package index:
# `DS_BUILD_OPS=0 pip wheel deepspeed --no-deps --no-build-isolation -w WHEEL_DIR` makes a pure-Python one.
#
# The steps, in this order, each under `timeout` (its budget, clipped to what is left of the 540 s; 5 s
# more to kill), its output in OUT/STEP.log, its status, exit code and seconds appended to
# OUT/summary.tsv as it finishes. benchmarks/preflight.py decides which later steps run (its reasons in
# the summary): without a Triton launch the loss table keeps its torch rows and the head table is
# skipped; without transformers the 2B step and the throughput tests are skipped, the loss table runs.
#   setup                 25  the wheels of benchmarks/gpu_wheels.txt, by name
#   preflight             20  python -m benchmarks.preflight (versions, gcc, Python.h, a Triton launch, ...)
#   gpu_tests_loss        50  pytest -v -rA tests/gpu/test_loss_cuda.py, less the cold torch.compile test
#   gpu_tests_head        15  pytest -v -rA tests/gpu/test_labelled_head_cuda.py (bf16 chunks on CUDA)
#   gpu_tests_throughput  45  pytest -v -rA tests/gpu/test_throughput_cuda.py (its own call: its
#                             collection needs transformers, psutil, PIL; the loss tests do not)
#   loss_table            90  python -m benchmarks.loss_speed --device cuda (rows to OUT/loss_table.jsonl;
#                             the preflight's methods, or $LOSS_METHODS: ntil_compiled/ntil_torch take minutes)
#   step_2b              200  python -m benchmarks.train_step --device cuda --model-size 2b: ours vs the HF
#                             Trainer, ZeRO-2 (the 141 GB recipe), 16 samples a step, 4 measured steps
#   head_table            40  python -m benchmarks.head_speed --device cuda --dtypes bfloat16 (JSONL rows)
#   compile_test          45  the cold torch.compile test, last and only if its whole budget is left
# = 530 s of 540. A step that fails or runs out of time makes the exit status 1; so does a GPU that
# nvidia-smi lists but torch cannot use (every GPU step then fails instead of being skipped).
set -u

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
  DRY_RUN=1
  shift
fi
case "${1:-}" in
  -*)
    echo "usage: bash benchmarks/gpu_check.sh [--dry-run] [WHEEL_DIR]" >&2
    exit 2
    ;;
esac
WHEELS=${1:-${NTIL_WHEELS:-}}
TOTAL_S=${GPU_CHECK_TOTAL_S:-540}
KILL_GRACE_S=5
STEPS=(setup:25 preflight:20 gpu_tests_loss:50 gpu_tests_head:15 gpu_tests_throughput:45 loss_table:90
  step_2b:200 head_table:40 compile_test:45)
LOSS_DTYPES=bf16,fp32
COMPILED_TEST=compiled_number_stage

# Both folders as absolute paths before the cd into the repository (they may be given relative to here).
mkdir -p "${OUT:-$PWD/gpu_check_out}" || exit 1
OUT_DIR=$(cd "${OUT:-$PWD/gpu_check_out}" && pwd)
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then WHEELS=$(cd "$WHEELS" && pwd); fi
SUMMARY=$OUT_DIR/summary.tsv
PLAN=$OUT_DIR/plan.tsv
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/ntil_gpu_check.XXXXXX") # not under OUT: it is copied back
trap 'rm -rf "$SCRATCH"' EXIT                                 # also when interrupted
FAILED=0
cd "$REPO" || exit 1

export PYTHONPATH="$SCRATCH/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET # carried over from a CPU shell it would run every kernel in the interpreter

GPU_LISTED=0 # nvidia-smi sees a GPU: then "cuda absent" is a failure, not a skip (a dry run fails nothing)
if [ "$DRY_RUN" = 0 ] && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU_LISTED=1
fi

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$([ "$DRY_RUN" = 1 ] && echo ' (dry run)')"
  printf '# step\tstatus\texit_code\tseconds\tbudget_s\tdetail\n'
} >"$SUMMARY"

record() { # STEP STATUS EXIT_CODE SECONDS BUDGET DETAIL
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$SUMMARY"
}

budget_of() { # STEP -> its budget in s
  local entry
  for entry in "${STEPS[@]}"; do
    [ "${entry%%:*}" = "$1" ] && echo "${entry##*:}" && return
  done
  echo 0
}

left_s() { echo $((TOTAL_S - SECONDS - KILL_GRACE_S)); }

# What each step runs, as an array CMD (the dry run prints it and runs its argument checks).
step_command() { # STEP EXTRA (methods for loss_table, overrides for step_2b)
  local pytest=("$PYTHON" -m pytest -v -rA --durations=15 -p no:cacheprovider)
  case $1 in
    setup) CMD=("$PYTHON" -m pip install --no-index --find-links "${WHEELS:-WHEEL_DIR}" --no-deps
      --no-compile -q --target "$SCRATCH/site" NAME) ;;
    preflight) CMD=("$PYTHON" -m benchmarks.preflight --out "$OUT_DIR") ;;
    gpu_tests_loss) CMD=("${pytest[@]}" tests/gpu/test_loss_cuda.py -k "not $COMPILED_TEST") ;;
    gpu_tests_head) CMD=("${pytest[@]}" tests/gpu/test_labelled_head_cuda.py) ;;
    gpu_tests_throughput) CMD=("${pytest[@]}" tests/gpu/test_throughput_cuda.py) ;;
    loss_table) CMD=("$PYTHON" -m benchmarks.loss_speed --device cuda --methods "${LOSS_METHODS:-${2:-cross_entropy,liger,ntil,ntil_eager}}"
      --dtypes "$LOSS_DTYPES" --jsonl "$OUT_DIR/loss_table.jsonl") ;;
    step_2b)
      # 4 measured steps of 16 clock samples (~5k tokens) per job after 1 warm-up, parameters built on
      # the GPU; ZeRO-2 as the 141 GB recipe says (the summary names the stage and the batch)
      CMD=("$PYTHON" -m benchmarks.train_step --device cuda --model-size 2b --steps 5 --warmup 1
        --samples 320 --workdir "$SCRATCH/train_step" --results "$OUT_DIR/step_2b_results.json"
        --keep-going train.global_batch_size=16)
      # shellcheck disable=SC2206 # the overrides are words without spaces, split on purpose
      [ -n "${2:-}" ] && CMD+=($2)
      ;;
    head_table) CMD=("$PYTHON" -m benchmarks.head_speed --device cuda --dtypes bfloat16
      --jsonl "$OUT_DIR/head_table.jsonl") ;;
    compile_test) CMD=("${pytest[@]}" tests/gpu/test_loss_cuda.py -k "$COMPILED_TEST") ;;
  esac
}

# The dry run's check of a step: its argument handling and imports, without CUDA.
dry_command() { # STEP: sets CMD to the check, or empty
  case $1 in
    gpu_tests_* | compile_test)
      local i
      for i in "${!CMD[@]}"; do [ "${CMD[$i]}" = "-v" ] && CMD[i]="--collect-only"; done
      CMD+=(-q)
      ;;
    loss_table | step_2b | head_table) CMD+=(--dry-run) ;;
    *) CMD=() ;;
  esac
}

shown() { # the command as one would type it: words with spaces or shell characters in single quotes
  local word words=()
  for word in "${CMD[@]}"; do
    if [[ $word =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then words+=("$word"); else words+=("'${word//\'/\'\\\'\'}'"); fi
  done
  echo "${words[*]}"
}

run_step() { # STEP BUDGET: runs CMD under timeout, output to the terminal and OUT/STEP.log
  local step=$1 budget=$2 started=$SECONDS rc status
  echo "== $step (budget ${budget} s): $(shown)"
  timeout --kill-after="$KILL_GRACE_S" "$budget" "${CMD[@]}" 2>&1 | tee "$OUT_DIR/$step.log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  [ "$rc" -eq 0 ] || FAILED=1
  echo "== $step: $status (exit $rc) in $((SECONDS - started)) s"
  record "$step" "$status" "$rc" "$((SECONDS - started))" "$budget" "log: $OUT_DIR/$step.log"
}

skip() { # STEP BUDGET REASON: a GPU that nvidia-smi lists but torch cannot use fails instead
  if [ "$GPU_LISTED" = 1 ] && [[ $3 == "cuda absent"* ]]; then
    echo "FAILED $1: nvidia-smi lists a GPU but torch cannot use it: $3"
    record "$1" failed - 0 "$2" "nvidia-smi lists a GPU but torch cannot use it: $3"
    FAILED=1
  else
    echo "SKIP $1: $3"
    record "$1" skipped - 0 "$2" "$3"
  fi
}

wheel_names() { # the manifest's distribution names that have a wheel in WHEEL_DIR (pip's name rules)
  local name file
  while read -r name _; do
    file=$(echo "$name" | tr '.-' '__') # a wheel's file name spells the distribution so (any case)
    if find "$WHEELS" -maxdepth 1 -iname "${file}-*.whl" | grep -q .; then
      echo "$name"
    else
      echo "$name not carried" >>"$OUT_DIR/wheels.tsv"
    fi
  done < <(sed 's/#.*//' benchmarks/gpu_wheels.txt | awk 'NF == 2')
}

setup_wheels() { # BUDGET: one pip call for all; if it fails, one per name, so each failure is named
  local budget=$1 started=$SECONDS names name rc failed=0
  : >"$OUT_DIR/wheels.tsv"
  if [ -z "$WHEELS" ]; then
    skip setup "$budget" "no wheel folder given (argument 1 or NTIL_WHEELS): using the installed packages"
    return
  fi
  mapfile -t names < <(wheel_names)
  if [ "${#names[@]}" -eq 0 ]; then
    skip setup "$budget" "no wheel of benchmarks/gpu_wheels.txt in $WHEELS: using the installed packages"
    return
  fi
  step_command setup
  if [ "$DRY_RUN" = 1 ]; then
    printf '%s would install\n' "${names[@]}" >>"$OUT_DIR/wheels.tsv"
    record setup "dry run" - 0 "$budget" "${#names[@]} wheels found: ${names[*]}"
    return
  fi
  echo "== setup (budget ${budget} s): ${CMD[*]/%NAME/${names[*]}}"
  timeout "$budget" "${CMD[@]:0:${#CMD[@]}-1}" "${names[@]}" >"$OUT_DIR/setup.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    printf '%s installed\n' "${names[@]}" >>"$OUT_DIR/wheels.tsv"
  else
    for name in "${names[@]}"; do
      if [ $((SECONDS - started)) -ge $((2 * budget)) ]; then # one at a time gets twice the budget
        echo "$name FAILED (not tried: the setup's time was spent)" >>"$OUT_DIR/wheels.tsv"
        failed=$((failed + 1))
        continue
      fi
      if timeout 20 "${CMD[@]:0:${#CMD[@]}-1}" "$name" >>"$OUT_DIR/setup.log" 2>&1; then
        echo "$name installed" >>"$OUT_DIR/wheels.tsv"
      else
        echo "$name FAILED (see setup.log)" >>"$OUT_DIR/wheels.tsv"
        failed=$((failed + 1))
      fi
    done
  fi
  find "$SCRATCH/site" -maxdepth 1 -name '*.dist-info' -printf '%f\n' 2>/dev/null | sort >"$OUT_DIR/installed.txt"
  cat "$OUT_DIR/wheels.tsv"
  if [ "$failed" -gt 0 ]; then
    FAILED=1
    record setup failed "$rc" "$((SECONDS - started))" "$budget" "$failed of ${#names[@]} wheels failed: $OUT_DIR/wheels.tsv"
  else
    record setup passed 0 "$((SECONDS - started))" "$budget" "${#names[@]} wheels: $OUT_DIR/wheels.tsv"
  fi
}

declare -A VERDICT REASON EXTRA
load_decisions() { # the preflight's decisions for every step, read once from OUT/preflight.json
  local step verdict reason extra
  while IFS=$'\t' read -r step verdict reason extra; do # "-": an empty field (tabs would collapse)
    [ "$reason" = - ] && reason=""
    [ "$extra" = - ] && extra=""
    VERDICT[$step]=$verdict REASON[$step]=$reason EXTRA[$step]=$extra
  done < <("$PYTHON" -m benchmarks.preflight --step all --from "$OUT_DIR/preflight.json" 2>/dev/null)
}

read_decision() { # STEP: sets verdict, reason and extra (no decision: run, and say why)
  verdict=${VERDICT[$1]:-run} reason=${REASON[$1]-no preflight decision (see preflight.log)}
  extra=${EXTRA[$1]:-}
}

# The plan: every step with its budget and command, and whether the preflight lets it run.
print_plan() {
  local entry step budget verdict reason extra="" total=0
  printf 'step\tbudget_s\twould_run\truns\n' >"$PLAN"
  for entry in "${STEPS[@]}"; do
    step=${entry%%:*} budget=${entry##*:} extra=""
    total=$((total + budget))
    case $step in
      setup) verdict=$([ -n "$WHEELS" ] && echo "yes ($WHEELS)" || echo "no (no wheel folder)") ;;
      preflight) verdict=yes ;;
      *)
        read_decision "$step"
        if [ "$verdict" = run ]; then verdict="yes${reason:+ ($reason)}"; else verdict="no ($reason)"; fi
        ;;
    esac
    step_command "$step" "$extra"
    printf '%s\t%s\t%s\t%s\n' "$step" "$budget" "$verdict" "$(shown)" >>"$PLAN"
  done
  printf 'total\t%s\t(of %s s)\t\n' "$total" "$TOTAL_S" >>"$PLAN"
  echo "plan ($PLAN):"
  column -t -s $'\t' "$PLAN" 2>/dev/null || cat "$PLAN"
}

# --- setup and preflight ------------------------------------------------------------------------------
setup_wheels "$(budget_of setup)"
step_command preflight
# GPU_CHECK_PREFLIGHT_S: a slow CPU machine's preflight (the tests, a dry run: 60) may need more than 20 s
preflight_s=$(budget_of preflight)
[ "$DRY_RUN" = 1 ] && preflight_s=60
preflight_s=${GPU_CHECK_PREFLIGHT_S:-$preflight_s}
run_step preflight "$preflight_s"
load_decisions
echo
print_plan
echo

# --- the GPU steps, in order --------------------------------------------------------------------------
for entry in "${STEPS[@]:2}"; do
  step=${entry%%:*} budget=${entry##*:}
  read_decision "$step"
  if [ "$verdict" = skip ]; then
    skip "$step" "$budget" "$reason"
    [ "$DRY_RUN" = 1 ] || continue # the dry run checks the step's arguments all the same
  fi
  step_command "$step" "$extra"
  if [ "$DRY_RUN" = 1 ]; then # the checks run side by side (seconds each), recorded in order below
    dry_command "$step"
    echo "== $step.dry_run: $(shown)"
    t0=$SECONDS
    (
      timeout 60 "${CMD[@]}" >"$OUT_DIR/$step.dry_run.log" 2>&1
      echo "$? $((SECONDS - t0))" >"$SCRATCH/$step.dry_run.rc"
    ) &
    continue
  fi
  left=$(left_s)
  if [ "$step" = compile_test ] && [ "$left" -lt "$budget" ]; then
    skip "$step" "$budget" "optional, and only $left s are left of the $TOTAL_S s"
    continue
  fi
  if [ "$left" -lt 10 ]; then
    skip "$step" "$budget" "no time left of the $TOTAL_S s"
    continue
  fi
  case $step in loss_table | head_table) : >"$OUT_DIR/$step.jsonl" ;; esac # this run's rows only
  run_step "$step" $((budget < left ? budget : left))
  if [ "$step" = step_2b ]; then # each job's records and log, whatever happened to the other
    for job in "$SCRATCH"/train_step/round*; do
      [ -d "$job" ] || continue
      for file in steps.json job.log; do
        [ -f "$job/$file" ] && cp "$job/$file" "$OUT_DIR/step_2b_$(basename "$job")_$file"
      done
    done
  fi
done

if [ "$DRY_RUN" = 1 ]; then
  wait
  for entry in "${STEPS[@]:2}"; do
    step=${entry%%:*}.dry_run
    read -r rc took <"$SCRATCH/$step.rc"
    [ "$rc" -eq 0 ] && status=passed || status=failed
    [ "$rc" -eq 0 ] || FAILED=1
    echo "== $step: $status (exit $rc); log $OUT_DIR/$step.log:"
    tail -n 3 "$OUT_DIR/$step.log"
    record "$step" "$status" "$rc" "$took" 60 "log: $OUT_DIR/$step.log"
  done
fi

echo "# total $SECONDS s of $TOTAL_S" >>"$SUMMARY"
echo
echo "summary ($SUMMARY):"
grep -v '^#' "$SUMMARY" | column -t -s $'\t' 2>/dev/null || cat "$SUMMARY"
exit "$FAILED"
