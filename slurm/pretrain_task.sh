#!/usr/bin/env bash
# One training process of slurm/pretrain_per_gpu.sbatch (srun starts one per GPU): Slurm's task
# variables as torch.distributed's, then `megadiff pretrain CONFIG [key=value ...]`, whose exit
# code (75: checkpointed after a preemption signal, requeue me) becomes srun's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/process_env.sh"

export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-1}
: "${MASTER_ADDR:?set by slurm/job.sh}" "${MASTER_PORT:?set by slurm/job.sh}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export_process_env 1
exec "$PYTHON" -m megadiff pretrain "$@"
