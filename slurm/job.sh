# shellcheck shell=bash
# Sourced by the megadiff sbatch scripts (not run on its own): the arguments check, the
# rendezvous address, `run_step_requeue_on_preemption srun ...` and `run_torchrun_per_node LAUNCHER ...`.
#
# Preemption: SIGUSR1 to the batch script (`#SBATCH --signal=B:USR1@SECONDS` before the time
# limit, or `scancel --batch --signal=USR1 JOBID`) is forwarded to every process of the job's
# steps: the training checkpoints after its current iteration and stops with exit code 75. The
# job is then requeued (it needs `#SBATCH --requeue`) and reruns the same command, which resumes
# from that checkpoint. A step whose training stopped for preemption on its own (its tasks were
# signalled directly, e.g. --signal without B:) is requeued too: it exits 75, or under torchrun
# leaves $MEGADIFF_REQUEUE_MARKER. SIGTERM (scancel, the time limit) reaches the step from Slurm as well: the script
# waits while the training checkpoints and does not requeue. Otherwise the job ends with the
# step's exit code. A step that fails otherwise after the signal (killed while saving, a save that
# failed) is requeued to resume from its last checkpoint, $MEGADIFF_MAX_UNCOMMITTED_REQUEUES (3)
# times in a row at most.

REQUEUE_EXIT_CODE=75   # megadiff.preemption.REQUEUE_EXIT_CODE

say() { echo "$(date '+%F %T') [slurm job ${SLURM_JOB_ID}] $*"; }

if [[ $# -lt 1 ]]; then
    echo "usage: sbatch slurm/<script>.sbatch CONFIG [key=value ...] (see the script's header)" >&2
    exit 2
fi
# before srun starts a process on every node, each of which would say so (under torchrun's traceback)
if [[ ! -f $1 ]]; then
    echo "config file not found: $1 (in $PWD, where the job was submitted; give a path from there)" >&2
    exit 2
fi

# The first node hosts the rendezvous (whatever MASTER_ADDR the submitting shell had); a port
# from the job id keeps two jobs sharing a node apart, below Linux's ephemeral ports (32768-60999),
# which an outgoing connection of the node may hold. The node count and each node's rank are
# Slurm's too: sbatch hands the job the submitting shell's environment, NNODES and NODE_RANK with it.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
# One left exported in the submitting shell is taken too, and named in the log: two jobs sharing a node
# on one port would have the second's ranks wait on the first's rendezvous
_megadiff_port_origin=${MASTER_PORT:+" (MASTER_PORT, set where the job was submitted)"}
export MASTER_PORT=${MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}
export NNODES=$SLURM_JOB_NUM_NODES
unset NODE_RANK
# Rank 0 (on this first node) leaves this file when it stops for preemption: through torchrun, the
# step's exit code is torchrun's own (1 when a worker exits otherwise than 0), not 75. It lies in a new
# directory of this run's alone (mode 700): a fixed name in /tmp is one anyone on the node can make
# first, which this job could not remove, and every failure would be requeued on it.
if ! _megadiff_marker_dir=$(mktemp -d "${TMPDIR:-/tmp}/megadiff-requeue-${SLURM_JOB_ID}.XXXXXX"); then
    echo "cannot make a directory in ${TMPDIR:-/tmp} for the requeue marker (set TMPDIR to a writable one)" >&2
    exit 2
fi
export MEGADIFF_REQUEUE_MARKER="$_megadiff_marker_dir/marker"
# Requeues in a row after which no checkpoint had been committed: kept across restarts (which may run
# on other nodes) beside the job's log, in the directory it was submitted from
UNCOMMITTED_REQUEUES="${SLURM_SUBMIT_DIR:-.}/.megadiff-uncommitted-requeues-${SLURM_JOB_ID}"
MAX_UNCOMMITTED_REQUEUES=${MEGADIFF_MAX_UNCOMMITTED_REQUEUES:-3}
say "restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NUM_NODES} nodes ($SLURM_JOB_NODELIST), rendezvous at" \
    "$MASTER_ADDR:$MASTER_PORT$_megadiff_port_origin, arguments: $*"

_megadiff_preempted=0
_megadiff_terminated=0
_megadiff_requeueing=0

_forward_preemption() {
    _megadiff_preempted=1
    say "SIGUSR1: asking the training to checkpoint and stop; the job will be requeued"
    # without --batch/--full, scancel signals the processes of the job's steps, not this shell
    scancel --signal=USR1 "$SLURM_JOB_ID"
}

_note_termination() {
    # a requeue ends this run of the job with SIGTERM too: nothing to tell
    (( _megadiff_requeueing )) && return
    _megadiff_terminated=1
    say "SIGTERM: the training checkpoints and stops; the job is not requeued"
}

# A busy controller may refuse a moment: a requeue that never happens must not end the job as done.
_requeue() {
    local attempt
    _megadiff_requeueing=1
    for attempt in 1 2 3 4 5; do
        scontrol requeue "$SLURM_JOB_ID" && exit 0
        sleep $(( attempt * 10 ))
    done
    say "scontrol requeue failed 5 times: the job ends here; resubmit it to resume from its checkpoint"
    rm -f "$UNCOMMITTED_REQUEUES"
    exit "$REQUEUE_EXIT_CODE"
}

run_step_requeue_on_preemption() {
    trap _forward_preemption USR1
    trap _note_termination TERM
    "$@" &
    local step=$! status
    # a trapped signal interrupts `wait` (status > 128) while the step may still run; the step may
    # also end during the trap, its status then held by bash for the last `wait`
    while kill -0 "$step" 2>/dev/null; do wait "$step"; done
    wait "$step"
    status=$?
    # 75 and the marker come once the preemption checkpoint is committed; another failure after the
    # signal (killed while saving, a save that failed) requeues from an older checkpoint, a few times
    # in a row at most, so that a save failing every time does not requeue the job for ever
    local committed=$(( status == REQUEUE_EXIT_CODE )) uncommitted=0
    [[ -e $MEGADIFF_REQUEUE_MARKER ]] && committed=1
    rm -rf "$_megadiff_marker_dir"
    [[ -e $UNCOMMITTED_REQUEUES ]] && uncommitted=$(< "$UNCOMMITTED_REQUEUES")
    if (( !_megadiff_terminated && committed )); then
        rm -f "$UNCOMMITTED_REQUEUES"
        say "the step stopped for preemption (exit code $status): requeueing (restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )))"
        _requeue
    elif (( !_megadiff_terminated && _megadiff_preempted && status != 0 )); then
        if [[ ! $uncommitted =~ ^[0-9]+$ ]]; then
            say "the count of requeues without a checkpoint in $UNCOMMITTED_REQUEUES is unreadable: not requeueing"
        elif (( uncommitted >= MAX_UNCOMMITTED_REQUEUES )); then
            say "the step failed after the preemption signal without a new checkpoint $(( uncommitted + 1 )) times" \
                "in a row: not requeueing (see the errors above; MEGADIFF_MAX_UNCOMMITTED_REQUEUES=$MAX_UNCOMMITTED_REQUEUES)"
        # a count that cannot be kept (a full disk, as a save failing every time may find) would requeue for ever
        elif ! echo $(( uncommitted + 1 )) 2>/dev/null > "$UNCOMMITTED_REQUEUES"; then
            say "the step failed after the preemption signal (exit code $status) without a new checkpoint, and the" \
                "count of such requeues cannot be kept in $UNCOMMITTED_REQUEUES: not requeueing"
        else
            say "the step failed after the preemption signal (exit code $status) without a new checkpoint:" \
                "requeueing to resume from the last one ($(( uncommitted + 1 )) of at most $MAX_UNCOMMITTED_REQUEUES in a row)"
            _requeue
        fi
    fi
    rm -f "$UNCOMMITTED_REQUEUES"
    say "the step finished with exit code $status"
    exit "$status"
}

# run_torchrun_per_node LAUNCHER ARGS...: one task per node running a launch/ script (torchrun over
# the node's GPUs; --gpus-per-node, "a100:8" -> 8, unless GPUS_PER_NODE is set), requeued on
# preemption. Each task gets all of its node's CPUs (srun no longer inherits sbatch's
# --cpus-per-task). --wait: once one node's torchrun has ended, the others get 5 minutes (e.g. to
# finish writing a checkpoint) before they are killed, rather than hanging in a collective.
run_torchrun_per_node() {
    local gpus=${SLURM_GPUS_PER_NODE:-0}
    gpus=${gpus##*:}
    if [[ -z ${GPUS_PER_NODE:-} && $gpus != 0 ]]; then
        export GPUS_PER_NODE=$gpus
    elif [[ $gpus != 0 && $GPUS_PER_NODE != "$gpus" ]]; then
        # sbatch hands the job the submitting shell's environment: an export left there would go unnoticed
        say "GPUS_PER_NODE=$GPUS_PER_NODE (set where the job was submitted) runs $GPUS_PER_NODE processes per node," \
            "not one per GPU of --gpus-per-node=$gpus"
    fi
    run_step_requeue_on_preemption srun --label --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --wait=300 "$@"
}
