#!/usr/bin/env bash
# Entry point of the ntil-ds image (docs/container.md).
#
#   <image> train --config configs/train/X.yaml [key=value ...]   training on this node's GPUs
#   <image> --config configs/train/X.yaml [key=value ...]         the same: leading options mean train
#   <image> <command> [args ...]                                   runs the command as given
#                                                                  (bash, python, deepspeed, torchrun, ds_report ...)
#   <image> help                                                   this text
#
# train runs launch/train.py under a launcher on one node:
#   NTIL_LAUNCHER    deepspeed (default) or torchrun
#   NPROC_PER_NODE   processes (GPUs) to start; default: every visible GPU
#   MASTER_PORT      deepspeed's rendezvous port (default 29500): set it when two jobs share a node
# Multi-node jobs start the launcher themselves (slurm/train.sh), as a plain command.
#
# Nothing here is needed for the image to work: pyxis/enroot and `apptainer exec` skip entry points, so
# the environment lives in the Dockerfile's ENV. This script only chooses what to run, then execs it,
# so the launcher gets the signals (docker stop, SLURM preemption) directly.
set -euo pipefail

ntil_home="${NTIL_HOME:-/workspace}"

usage() {
    # The comment block at the top of this file.
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

train() {
    local launcher="${NTIL_LAUNCHER:-deepspeed}"
    local port="${MASTER_PORT:-29500}"
    local -a command
    case "$launcher" in
        deepspeed)
            command=(deepspeed --master_port "$port")
            if [[ -n "${NPROC_PER_NODE:-}" ]]; then
                command+=(--num_gpus "$NPROC_PER_NODE")
            fi
            ;;
        torchrun)
            # --standalone: a private rendezvous on a free port, so two jobs on one node never collide.
            command=(torchrun --standalone --nproc_per_node "${NPROC_PER_NODE:-gpu}")
            ;;
        *)
            echo "entrypoint: NTIL_LAUNCHER must be 'deepspeed' or 'torchrun', not '$launcher'" >&2
            exit 2
            ;;
    esac
    if [[ ! -f "$ntil_home/launch/train.py" ]]; then
        echo "entrypoint: $ntil_home/launch/train.py not found: set NTIL_HOME to the project folder" >&2
        exit 2
    fi
    exec "${command[@]}" "$ntil_home/launch/train.py" "$@"
}

case "${1:-help}" in
    help | -h | --help)
        usage
        ;;
    train)
        shift
        train "$@"
        ;;
    -*)
        train "$@"
        ;;
    *)
        exec "$@"
        ;;
esac
