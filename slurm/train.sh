#!/bin/bash
# ntil-ds on SLURM: multi-node DeepSpeed ZeRO-3 training that survives preemption and time limits.
#
#   sbatch slurm/train.sh configs/train/X.yaml [key=value ...]          (submit from the repo root)
#   sbatch --nodes=4 --time=2:00:00 slurm/train.sh configs/train/X.yaml  (sbatch options override #SBATCH)
#   DRY_RUN=1 SLURM_JOB_NODELIST='gpu[01-04]' bash slurm/train.sh configs/train/X.yaml   (print only)
#
# What happens (docs/slurm.md has the long version):
#   1. One srun task per node runs slurm/launch_node.sh, which starts `deepspeed --no_ssh` for that
#      node (why deepspeed and not torchrun: see launch_node.sh). Rank 0 lives on the first node.
#   2. SLURM sends USR1 to this script (--signal=B:USR1@300: 300 s before the time limit, or when you
#      run `scancel --batch --signal=USR1 JOBID`). The trap touches $NTIL_PREEMPT_FLAG; the ranks see
#      it at the next step boundary (ntil_ds/preemption.py), checkpoint together and exit with 85.
#   3. On 85 this script requeues the job (scontrol requeue). The next start removes the flag and
#      trains on from the newest complete checkpoint in output_dir (resume=auto).
#
# Edit these defaults for your cluster. #SBATCH lines are read by sbatch, not by bash: they cannot
# use shell variables.
#SBATCH --job-name=ntil-ds
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --signal=B:USR1@300
# (--time must be well above the 300 s warning: SLURM sends the warning at once to a shorter job,
#  and every requeued start would stop again at its first step.)
#
# Environment knobs (all optional):
#   ACCELERATOR=cuda|cpu      cpu: gloo on CPU processes (DS_ACCELERATOR=cpu), for tests and debugging
#   NPROC_PER_NODE=N          training processes per node [GPUs SLURM gave the job on a node; 1 on cpu]
#   MASTER_PORT=P             rendezvous port on the first node [20000 + job id % 20000]
#   NTIL_REPO=DIR             the ntil-ds checkout [the directory sbatch was run from]
#   TRAIN_SCRIPT=PATH         entry point, relative to NTIL_REPO [launch/train.py]
#   NTIL_PREEMPT_FLAG=PATH    preemption flag file, on a filesystem the first node's ranks see
#                             [$NTIL_REPO/.slurm/preempt.<job id>]
#   CONTAINER_IMAGE=IMAGE     run each node's launcher in this image (empty: the submitting environment)
#   CONTAINER_RUNTIME=pyxis|apptainer   [pyxis: srun --container-image; apptainer: apptainer exec]
#   CONTAINER_MOUNTS=SRC:DST[,...]      [$NTIL_REPO:$NTIL_REPO]
#   DEEPSPEED_TIMEOUT=MIN     how long a rank waits in a collective for a peer before it fails [10]
#   NTIL_COLLECTIVE_TIMEOUT_S=S  the same in seconds (wins over DEEPSPEED_TIMEOUT) [unset]
#   NCCL_* / TORCH_NCCL_*     exported as set; defaults below
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME   the network the ranks talk over (NCCL / gloo on CPU)
#   DRY_RUN=1                 print the srun line and each node's command, start nothing
set -euo pipefail

die() {
    echo "slurm/train.sh: error: $*" >&2
    exit 2
}
log() { echo "[train.sh $(date +%H:%M:%S)] $*"; }

if (($# < 1)); then
    die "usage: sbatch slurm/train.sh configs/train/RECIPE.yaml [key=value ...]"
fi
recipe=$1
shift
overrides=("$@")

DRY_RUN=${DRY_RUN:-0}
NTIL_REPO=${NTIL_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
TRAIN_SCRIPT=${TRAIN_SCRIPT:-launch/train.py}
ACCELERATOR=${ACCELERATOR:-cuda}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
CONTAINER_RUNTIME=${CONTAINER_RUNTIME:-pyxis}
CONTAINER_MOUNTS=${CONTAINER_MOUNTS:-$NTIL_REPO:$NTIL_REPO}
SLURM_JOB_ID=${SLURM_JOB_ID:-0}
restart_count=${SLURM_RESTART_COUNT:-0}

# sbatch copies this script to a spool folder, so paths are relative to the checkout, not to $0.
cd "$NTIL_REPO" || die "NTIL_REPO=$NTIL_REPO is not a directory (submit from the repo root or set NTIL_REPO)"
[[ -f "$TRAIN_SCRIPT" ]] || die "$NTIL_REPO/$TRAIN_SCRIPT not found (submit from the repo root or set NTIL_REPO)"
[[ -f "$recipe" ]] || die "recipe $recipe not found in $NTIL_REPO (give a YAML file from configs/train/)"
[[ -f slurm/launch_node.sh ]] || die "$NTIL_REPO/slurm/launch_node.sh not found"
case "$ACCELERATOR" in
    cuda | cpu) ;;
    *) die "ACCELERATOR=$ACCELERATOR: use cuda or cpu" ;;
esac

# ---- the allocation --------------------------------------------------------------------------------
nodelist=${SLURM_JOB_NODELIST:-$(hostname -s)}
mapfile -t nodes < <(scontrol show hostnames "$nodelist")
((${#nodes[@]} > 0)) || die "could not expand the node list '$nodelist' with scontrol"
if [[ -n "${SLURM_NNODES:-}" && "$SLURM_NNODES" != "${#nodes[@]}" ]]; then
    die "SLURM_NNODES=$SLURM_NNODES but the node list '$nodelist' has ${#nodes[@]} hosts"
fi
export NTIL_NODES="${nodes[*]}"
export MASTER_ADDR=${MASTER_ADDR:-${nodes[0]}}
if [[ -z "${MASTER_PORT:-}" ]]; then
    # Derived from the job id so two jobs sharing a node do not fight over one port.
    if [[ "$SLURM_JOB_ID" =~ ^[0-9]+$ ]]; then MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)); else MASTER_PORT=29500; fi
fi
export MASTER_PORT

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if [[ "$ACCELERATOR" == cpu ]]; then
        NPROC_PER_NODE=1
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
    elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
        NPROC_PER_NODE=${SLURM_GPUS_PER_NODE##*:} # "a100:8" -> 8
    elif command -v nvidia-smi >/dev/null; then
        NPROC_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
    fi
fi
[[ "${NPROC_PER_NODE:-}" =~ ^[1-9][0-9]*$ ]] ||
    die "cannot tell how many processes to start per node (got '${NPROC_PER_NODE:-}'): request GPUs with --gpus-per-node or set NPROC_PER_NODE"
export NPROC_PER_NODE

# ---- what every rank inherits ----------------------------------------------------------------------
if [[ "$ACCELERATOR" == cpu ]]; then
    export DS_ACCELERATOR=cpu
fi
# One thread per rank unless the job has cores to spare: oversubscribed ranks are slower, not faster.
cpus=${SLURM_CPUS_PER_TASK:-$NPROC_PER_NODE}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / NPROC_PER_NODE > 0 ? cpus / NPROC_PER_NODE : 1))}
export PYTHONUNBUFFERED=1
# The checkout's ntil_ds is the one that runs, installed (pip install -e) or not.
export PYTHONPATH="$NTIL_REPO${PYTHONPATH:+:$PYTHONPATH}"
# NCCL: warnings in the log; a failed or timed-out collective aborts the rank (so srun ends the job)
# instead of hanging until the time limit. Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your fabric.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
# A lost peer (dead node, cut link) shows up as a collective that never completes. Every process group
# of the trainer waits at most this long (minutes), then the ranks fail and rank 0 names the ranks that
# no longer answer (launch/train.py). Longer than anything one rank does while the others wait at a
# collective (a checkpoint save, rank 0's export), shorter than the hours a hang would burn.
export DEEPSPEED_TIMEOUT=${DEEPSPEED_TIMEOUT:-10}
export NTIL_PREEMPT_FLAG=${NTIL_PREEMPT_FLAG:-$NTIL_REPO/.slurm/preempt.$SLURM_JOB_ID}
# Each node's launch_node.sh leaves its launchers' exit code here (node 0's is on this host).
export NTIL_NODE_EXIT_DIR=${NTIL_NODE_EXIT_DIR:-$NTIL_PREEMPT_FLAG.exit}

train_args=("$TRAIN_SCRIPT" --config "$recipe" "${overrides[@]}")
if ((restart_count > 0)); then
    # A requeued start always continues from the newest complete checkpoint, whatever the first start
    # was told (the last key=value wins).
    train_args+=(resume=auto)
fi

srun_args=(--nodes="${#nodes[@]}" --ntasks="${#nodes[@]}" --ntasks-per-node=1 --kill-on-bad-exit=1)
node_cmd=(bash slurm/launch_node.sh "${train_args[@]}")
if [[ -n "$CONTAINER_IMAGE" ]]; then
    case "$CONTAINER_RUNTIME" in
        pyxis) srun_args+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$CONTAINER_MOUNTS" --container-workdir="$NTIL_REPO") ;;
        apptainer)
            nv=()
            [[ "$ACCELERATOR" == cuda ]] && nv=(--nv)
            node_cmd=(apptainer exec "${nv[@]}" --bind "$CONTAINER_MOUNTS" --pwd "$NTIL_REPO" "$CONTAINER_IMAGE" "${node_cmd[@]}")
            ;;
        *) die "CONTAINER_RUNTIME=$CONTAINER_RUNTIME: use pyxis or apptainer" ;;
    esac
fi

if [[ "$DRY_RUN" == 1 ]]; then
    echo "# job ${SLURM_JOB_ID}: ${#nodes[@]} node(s) x ${NPROC_PER_NODE} processes, rank 0 on ${MASTER_ADDR}:${MASTER_PORT}"
    echo "# batch script runs:"
    printf '%q ' srun "${srun_args[@]}" "${node_cmd[@]}"
    printf '\n'
    for i in "${!nodes[@]}"; do
        echo "# node $i (${nodes[$i]}) runs:"
        SLURM_NODEID=$i SLURM_JOB_ID=$SLURM_JOB_ID DRY_RUN=1 bash slurm/launch_node.sh "${train_args[@]}"
    done
    exit 0
fi

# ---- run, with preemption ----------------------------------------------------------------------------
EXIT_PREEMPTED=85 # ntil_ds/preemption.py
mkdir -p "$(dirname "$NTIL_PREEMPT_FLAG")"
# A flag left by the run before a requeue must not stop this one at its first step; nor may its exit codes
# be read as this run's.
rm -rf "$NTIL_PREEMPT_FLAG" "$NTIL_NODE_EXIT_DIR"

signalled=0 # a trap ran while we were waiting for srun
terminated=0
# shellcheck disable=SC2317  # trap handlers are called indirectly
on_usr1() {
    signalled=1
    log "USR1: asking all ranks to checkpoint at the next step boundary (touch $NTIL_PREEMPT_FLAG)"
    touch "$NTIL_PREEMPT_FLAG"
}
# shellcheck disable=SC2317
on_term() {
    # scancel, the hard time limit or a preemption with GraceTime. SLURM signals the ranks too and
    # kills them after KillWait; the flag gives them a chance to checkpoint before that.
    signalled=1
    terminated=1
    log "TERM: job is being stopped by SLURM; asking the ranks for a last checkpoint"
    touch "$NTIL_PREEMPT_FLAG"
}
trap on_usr1 USR1
trap on_term TERM
trap 'rm -rf "$NTIL_PREEMPT_FLAG" "$NTIL_NODE_EXIT_DIR"' EXIT

log "job ${SLURM_JOB_ID} start $((restart_count + 1)): ${#nodes[@]} node(s) [${NTIL_NODES}] x ${NPROC_PER_NODE} processes, rank 0 on ${MASTER_ADDR}:${MASTER_PORT}"
for i in "${!nodes[@]}"; do # node-major (launch_node.sh): what an error naming a rank refers to
    log "node $i ${nodes[$i]}: ranks $((i * NPROC_PER_NODE))-$(((i + 1) * NPROC_PER_NODE - 1))"
done
log "srun ${srun_args[*]} ${node_cmd[*]}"
# srun in the background: bash runs a trap only when the foreground command ends, and `wait` returns
# as soon as a trapped signal arrives.
srun "${srun_args[@]}" "${node_cmd[@]}" &
srun_pid=$!
while true; do
    signalled=0
    rc=0
    wait "$srun_pid" || rc=$?
    # Interrupted by a trap: srun is still running (or its status is kept for the next wait).
    ((signalled)) || break
done
# launch_node.sh turns the launchers' 85 into 0 for srun (see there); node 0's file holds the real code.
node0_exit=$(cat "$NTIL_NODE_EXIT_DIR/node0" 2>/dev/null || true)
if ((rc == 0)) && [[ "$node0_exit" == "$EXIT_PREEMPTED" ]]; then
    rc=$EXIT_PREEMPTED
fi

if ((rc == EXIT_PREEMPTED)); then
    if ((terminated)); then
        log "ranks checkpointed (exit $rc) but SLURM is stopping the job: not requeueing"
        exit "$rc"
    fi
    log "ranks checkpointed (exit $rc): requeueing job ${SLURM_JOB_ID}; the next start resumes from the checkpoint"
    if scontrol requeue "$SLURM_JOB_ID" || ((terminated)); then
        # SLURM ends this run as part of the requeue (its TERM may even cut scontrol short).
        exit "$rc"
    fi
    die "scontrol requeue $SLURM_JOB_ID failed: resubmit the same command by hand; it resumes from the checkpoint"
fi
log "training exited with $rc"
exit "$rc"
