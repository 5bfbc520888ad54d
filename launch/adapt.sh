#!/usr/bin/env bash
# Dex/DAA adaptation with DeepSpeed ZeRO (megadiff adapt) under torchrun, on one node or across nodes.
#
#   launch/adapt.sh CONFIG [key=value ...]                                  # this machine
#   MASTER_ADDR=node0 MASTER_PORT=29500 NNODES=2 NODE_RANK=0 launch/adapt.sh CONFIG [key=value ...]
#
# One process per GPU. Across nodes run it once on every node, each with its own NODE_RANK; node
# rank 0 hosts the rendezvous at MASTER_ADDR:MASTER_PORT (torchrun's static rendezvous), and
# output_dir must be on a filesystem every node sees. Under Slurm NNODES and NODE_RANK default to
# SLURM_JOB_NUM_NODES and SLURM_NODEID (slurm/adapt.sbatch runs this once per node).
# Rerunning the same command continues from the latest checkpoint in output_dir. SIGTERM or
# SIGUSR1: the workers checkpoint and stop (exit code 75). Other environment: GPUS_PER_NODE,
# PYTHON, OMP_NUM_THREADS, TORCH_ELASTIC_SHUTDOWN_TIMEOUT (launch/torchrun_env.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/torchrun_env.sh"

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
if (( NNODES == 1 )); then
    megadiff_torchrun --standalone -m megadiff adapt "$@"
fi
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (this node, 0..NNODES-1)}}
: "${MASTER_ADDR:?set MASTER_ADDR (the host of node rank 0)}"
MASTER_PORT=${MASTER_PORT:-29500}

megadiff_torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" \
    --master-port "$MASTER_PORT" -m megadiff adapt "$@"
