#!/usr/bin/env bash
# Pre-train on this machine with one process per GPU (torchrun, standalone rendezvous).
#
#   launch/pretrain_single_node.sh CONFIG [key=value ...]
#
# Rerunning the same command continues from the latest checkpoint in output_dir.
# Environment: GPUS_PER_NODE (processes; default: the visible GPUs, 1 without GPU),
# PYTHON (default python3), OMP_NUM_THREADS, TORCHELASTIC_SIGNALS_TO_HANDLE,
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (see launch/torchrun_env.sh and docs/launch.md).
# SIGTERM or SIGUSR1 to this process: the workers checkpoint and stop (torchrun then exits non-zero).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/torchrun_env.sh"

megadiff_torchrun --standalone -m megadiff pretrain "$@"
