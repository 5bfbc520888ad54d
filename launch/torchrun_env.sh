# shellcheck shell=bash
# Sourced by the torchrun launchers (not run on its own): torchrun's settings for megadiff and
# `megadiff_torchrun ARGS...`. Every variable can be preset by the caller.
source "$(dirname "${BASH_SOURCE[0]}")/process_env.sh"

# Processes per node: one per visible GPU (CUDA_VISIBLE_DEVICES counts), one without a GPU.
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    GPUS_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi
export_process_env "$GPUS_PER_NODE"

# The signals torchrun forwards to its workers. Its default lacks SIGUSR1 (the usual "time is
# nearly up" signal), which would kill the agent instead. torchrun's --signals-to-handle reads
# PET_SIGNALS_TO_HANDLE and overwrites TORCHELASTIC_SIGNALS_TO_HANDLE, which older torch reads.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}}
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
# torchrun forwards SIGUSR1 from torch 2.9 on (pytorch#160690): an older one dies of it, and its workers with it,
# before they checkpoint. Said, not refused: SIGTERM still checkpoints, and a run never preempted needs neither.
if [[ $_megadiff_torch_version =~ ^2\.[0-8]\. ]]; then
    echo "megadiff: torchrun of torch $_megadiff_torch_version does not forward SIGUSR1 (torch 2.9 does): a" \
         "preemption signal by SIGUSR1 (slurm/*.sbatch: --signal=B:USR1) ends the run without its checkpoint;" \
         "upgrade torch" >&2
fi
# After forwarding a signal torchrun SIGKILLs the workers that are still running this many
# seconds later (torch's default: 30). The preemption checkpoint of a large model takes longer.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}

# `exec` it: the launcher's process becomes torchrun, so signals sent to it reach the agent.
megadiff_torchrun() {
    exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" "$@"
}

# megadiff_torchrun_nodes ARGS...: this node's part of a run across NNODES nodes. Node rank 0
# hosts torchrun's static rendezvous at MASTER_ADDR:MASTER_PORT, as in Megatron-LM's examples, so
# global ranks follow node ranks. NNODES and NODE_RANK default to Slurm's SLURM_JOB_NUM_NODES and
# SLURM_NODEID (an sbatch script runs the launcher once per node).
megadiff_torchrun_nodes() {
    local nnodes=${NNODES:-${SLURM_JOB_NUM_NODES:?set NNODES (the number of nodes)}}
    local node_rank=${NODE_RANK:-${SLURM_NODEID:?set NODE_RANK (this node, 0..NNODES-1)}}
    : "${MASTER_ADDR:?set MASTER_ADDR (the host of node rank 0)}"
    megadiff_torchrun --nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$MASTER_ADDR" \
        --master-port "${MASTER_PORT:-29500}" "$@"
}
