#!/usr/bin/env bash
# Pre-train across nodes: run this once on every node, each with its own NODE_RANK.
#
#   MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 launch/pretrain_multi_node.sh CONFIG [key=value ...]
#
# Node rank 0 hosts the rendezvous at MASTER_ADDR:MASTER_PORT (torchrun's static rendezvous,
# as Megatron-LM's examples): global ranks follow node ranks. output_dir must be on a
# filesystem every node sees. Under Slurm, NNODES and NODE_RANK default to SLURM_JOB_NUM_NODES
# and SLURM_NODEID (slurm/pretrain.sbatch runs this once per node).
# Other environment: GPUS_PER_NODE, PYTHON, ... as launch/pretrain_single_node.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/torchrun_env.sh"

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:?set NNODES (the number of nodes)}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (this node, 0..NNODES-1)}}
: "${MASTER_ADDR:?set MASTER_ADDR (the host of node rank 0)}"
MASTER_PORT=${MASTER_PORT:-29500}

megadiff_torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" -m megadiff pretrain "$@"
