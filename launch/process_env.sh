# shellcheck shell=bash
# Sourced by the megadiff launchers (not run on its own): the environment a `megadiff pretrain`
# under torchrun wants, and the common torchrun arguments. Every variable can be preset by the caller.

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0" >&2   # the calling launcher's header comment is its usage
    exit 2
fi

PYTHON=${PYTHON:-python3}   # the interpreter of the environment megadiff is installed in

# Processes per node: one per visible GPU (CUDA_VISIBLE_DEVICES counts), one without a GPU.
if [[ -z ${GPUS_PER_NODE:-} ]]; then
    GPUS_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)')
fi

# The signals torchrun forwards to its workers. Its default lacks SIGUSR1 (the usual "time is
# nearly up" signal), which would kill the agent instead. torchrun's --signals-to-handle reads
# PET_SIGNALS_TO_HANDLE and overwrites TORCHELASTIC_SIGNALS_TO_HANDLE, which older torch reads.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}}
export TORCHELASTIC_SIGNALS_TO_HANDLE=$PET_SIGNALS_TO_HANDLE
# After forwarding a signal torchrun SIGKILLs the workers that are still running this many
# seconds later (torch's default: 30). The preemption checkpoint of a large model takes longer.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-240}
# The node's cores shared by its ranks (torchrun's own default is 1 thread per rank).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / GPUS_PER_NODE > 0 ? $(nproc) / GPUS_PER_NODE : 1 ))}
# megatron-core overlaps tensor/sequence-parallel communication with compute only when kernels
# are issued in order on a single hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A rank whose NCCL collective fails or times out aborts instead of hanging the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

# `exec` it: the launcher's process becomes torchrun, so signals sent to it reach the agent.
megadiff_torchrun() {
    exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS_PER_NODE" "$@"
}
