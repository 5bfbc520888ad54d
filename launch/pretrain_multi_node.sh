#!/usr/bin/env bash
# Pre-train across nodes: run this once on every node, each with its own NODE_RANK.
#
#   MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 launch/pretrain_multi_node.sh CONFIG [key=value ...]
#
# Node rank 0 hosts the rendezvous at MASTER_ADDR:MASTER_PORT (default port 29500; torchrun's
# static rendezvous): global ranks follow node ranks. output_dir must be on a filesystem every
# node sees. Under Slurm, NNODES and NODE_RANK default to SLURM_JOB_NUM_NODES and SLURM_NODEID
# (slurm/pretrain.sbatch runs this once per node).
# Other environment: GPUS_PER_NODE, PYTHON, ... as launch/pretrain_single_node.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/torchrun_env.sh"

megadiff_torchrun_nodes -m megadiff pretrain "$@"
