# shellcheck shell=bash
# Sourced by every megadiff launcher (not run on its own): the arguments check, the interpreter and
# the environment of a training process. Every variable can be preset by the caller.

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0" >&2   # the calling launcher's header comment is its usage
    exit 2
fi

PYTHON=${PYTHON:-python3}   # the interpreter of the environment megadiff is installed in
# torch too: run from the repository root, `import megadiff` alone finds the source tree in any interpreter
if ! _megadiff_import=$("$PYTHON" -c 'import megadiff, torch; print(torch.__version__)' 2>&1); then
    echo "$(basename "$0"): $PYTHON cannot import megadiff ($(tail -n 1 <<< "$_megadiff_import")):" \
         "activate the environment it is installed in (source .venv/bin/activate) or set" \
         "PYTHON=/path/to/that/bin/python" >&2
    exit 2
fi
_megadiff_torch_version=$(tail -n 1 <<< "$_megadiff_import")

# export_process_env PROCESSES_ON_THIS_NODE
export_process_env() {
    local cores
    cores=$(nproc)
    # The node's cores shared by its processes (torchrun's own default is 1 thread per process).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / $1 > 0 ? cores / $1 : 1 ))}
    # megatron-core overlaps tensor/sequence-parallel communication with compute only when kernels
    # are issued in order on a single hardware queue.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    # A rank whose NCCL collective fails or times out aborts instead of hanging the job.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    # A rank that dies in native code (segfault, abort, a fatal CUDA error) prints every thread's
    # Python stack first, so the log says where.
    export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
    # The fused kernel's compiled and autotuned variants, on the node's own disk: Triton's default
    # (~/.triton, often a network home) shared by every rank of every node fails now and then under
    # concurrent writers ("Stale file handle"), which crashes a rank at its first step.
    megadiff_node_cache TRITON_CACHE_DIR triton "~/.triton"
    # torch.compile's (the differential combination, DINT's integral): torch's default, /tmp/torchinductor_$USER,
    # is a name another user of the node can make first as well, and its compiled kernels load as native code too
    megadiff_node_cache TORCHINDUCTOR_CACHE_DIR inductor "torch's /tmp/torchinductor_\$USER"
}

# megadiff_node_cache VAR NAME DEFAULT: unless VAR is set, export VAR=$TMPDIR/megadiff-NAME-$USER, a directory of
# this user's alone; where that name is not one, VAR stays unset (the tool's DEFAULT), and this is said.
megadiff_node_cache() {
    [[ -n ${!1:-} ]] && return
    local node_cache=${TMPDIR:-/tmp}/megadiff-$2-${USER:-$(id -u)}
    if megadiff_own_private_dir "$node_cache"; then
        export "$1=$node_cache"
    else
        echo "megadiff: $node_cache is not a directory of this user's alone (another user's, a link, or" \
             "writable by others): $1 stays at its default, $3; remove it (or, made by you and written by" \
             "no one else, chmod 700 it), or set $1 to one of your own" >&2
    fi
}

# megadiff_own_private_dir DIR: DIR exists (made here, mode 700) as a directory of this user's that no one else
# may write. A name in /tmp that another user on the node made first would give them the cache's contents,
# and Triton loads the compiled launchers it finds there as native code.
megadiff_own_private_dir() {
    mkdir -p -m 700 -- "$1" 2>/dev/null
    [[ -d $1 && ! -L $1 && -O $1 && -z $(find "$1" -maxdepth 0 -perm /022) ]]
}
