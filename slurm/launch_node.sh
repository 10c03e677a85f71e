#!/bin/bash
# Per-node launcher. slurm/train.sh starts one copy on every node of the job (srun, one task per node);
# each copy starts that node's NPROC_PER_NODE training processes with DeepSpeed's launcher, without ssh:
#
#   deepspeed --no_ssh --node_rank=<this node> --hostfile=<all nodes> --master_addr=<first node> ...
#
# Why the deepspeed launcher and not torchrun: it hands the training processes' exit code back to us
# (torchrun reports any worker failure as 1), and the batch script needs to see 85 (EXIT_PREEMPTED in
# ntil_ds/preemption.py) to requeue the job. It also kills a node's other ranks as soon as one dies.
#
# The exit code 85 must reach the batch script, but not through srun: srun --kill-on-bad-exit reads it
# as a failure and kills the nodes still on their way out with the same 85 (their tasks then end
# "Terminated" and srun returns 143, not 85). So this script writes the launcher's exit code to
# $NTIL_NODE_EXIT_DIR/node<SLURM_NODEID> and, for 85 once that file is written, exits 0; train.sh reads
# node 0's file (node 0 is the batch host) and requeues on 85.
#
# Environment (exported by slurm/train.sh): NTIL_NODES (the job's hosts, in SLURM node order),
# NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, NTIL_NODE_EXIT_DIR (optional); SLURM_NODEID and
# SLURM_JOB_ID come from srun.
# Arguments: the training script and its arguments. DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

: "${NTIL_NODES:?the host names of the job, space separated (slurm/train.sh sets it)}"
: "${NPROC_PER_NODE:?processes per node (slurm/train.sh sets it)}"
: "${MASTER_ADDR:?host of rank 0 (slurm/train.sh sets it)}"
: "${MASTER_PORT:?rendezvous port (slurm/train.sh sets it)}"
: "${SLURM_NODEID:?the index of this node in the job (srun sets it)}"
if (($# == 0)); then
    echo "usage: launch_node.sh TRAIN_SCRIPT [ARGS...]" >&2
    exit 2
fi

# DeepSpeed learns the world layout (how many ranks each node has, hence this node's first global
# rank) from a hostfile; with --no_ssh it never connects to the hosts listed there.
hostfile="${TMPDIR:-/tmp}/ntil-ds-hostfile.${SLURM_JOB_ID:-0}.${SLURM_NODEID}"
hostfile_text=""
for host in $NTIL_NODES; do
    hostfile_text+="${host} slots=${NPROC_PER_NODE}"$'\n'
done

cmd=(
    deepspeed --no_ssh
    --node_rank="$SLURM_NODEID"
    --hostfile="$hostfile"
    --master_addr="$MASTER_ADDR"
    --master_port="$MASTER_PORT"
    "$@"
)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s' "$hostfile_text" | sed "s|^|# ${hostfile}: |"
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi

printf '%s' "$hostfile_text" >"$hostfile"
echo "[launch_node] $(hostname -s) node_rank=${SLURM_NODEID}: ${cmd[*]}"
rc=0
"${cmd[@]}" || rc=$?
EXIT_PREEMPTED=85 # ntil_ds/preemption.py
if [[ -n "${NTIL_NODE_EXIT_DIR:-}" ]] && mkdir -p "$NTIL_NODE_EXIT_DIR" &&
    echo "$rc" >"$NTIL_NODE_EXIT_DIR/node${SLURM_NODEID}" && ((rc == EXIT_PREEMPTED)); then
    echo "[launch_node] $(hostname -s) node_rank=${SLURM_NODEID}: ranks checkpointed (exit $rc)"
    exit 0
fi
exit "$rc"
