#!/bin/bash
# Gossip training on a SLURM cluster: one gossip-node per task (here: per GPU).
#
#   sbatch examples/slurm_job.sh                       # 4 nodes x 2 tasks, digits, exponential graph
#   sbatch --nodes=8 examples/slurm_job.sh --steps 5000 --compression topk:0.01
#
# Extra arguments go to every gossip-node. `gossip-node --slurm` takes its listen
# address, its peers (every task of the step), its rank and the world size from
# the srun environment: task SLURM_LOCALID of each host listens on
# PORT + SLURM_LOCALID, so the ports below must be free on the compute nodes and
# reachable between them. There is no rank 0: any task may fail or finish first.
#
#SBATCH --job-name=gossip
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --output=gossip-%j.out

set -euo pipefail

PORT=${GOSSIP_PORT:-29400}                          # base port: task i of a host listens on PORT + i
OUT=${GOSSIP_OUT:-runs/slurm-${SLURM_JOB_ID:-local}}   # metrics, TensorBoard runs, checkpoints
mkdir -p "$OUT"
export OUT PORT

# One shell per task, so that each names its own metrics file and checkpoint folder.
# --kill-on-bad-exit=0: one failing node must not take the cluster down (the others carry on).
srun --kill-on-bad-exit=0 bash -c '
  exec gossip-node --slurm --slurm-port "$PORT" \
    --topology exponential --task digits --steps 2000 --period 1 \
    --threads "${SLURM_CPUS_PER_TASK:-1}" --device auto \
    --log "$OUT/node-$SLURM_PROCID.jsonl" \
    --checkpoint-dir "$OUT/ckpt-$SLURM_PROCID" --checkpoint-every 500 \
    --json "$@"
' gossip-node "$@"

# TensorBoard: add --tensorboard "$OUT/tb" above (pip install 'gossip-trainer[tensorboard]'), then
#   tensorboard --logdir "$OUT/tb"          # one run per node, named after its HOST_PORT
