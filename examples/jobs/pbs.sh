#!/bin/bash
# Train the FSDP x TP example on a PBS Pro / Torque allocation: `launch` reads $PBS_NODEFILE and
# runs one rank per slot with this environment's mpiexec (Open MPI, MPICH or Intel MPI flags).
#
#   qsub examples/jobs/pbs.sh
#   qsub -v MMM_ARGS="--max-iters 200 --dim 512" examples/jobs/pbs.sh   # extra trainer flags
#
#PBS -N mmm-fsdp-tp
#PBS -l select=2:ncpus=32:mpiprocs=4    # 2 hosts, 4 ranks each (Torque: -l nodes=2:ppn=4)
#PBS -l walltime=00:30:00
#PBS -j oe                              # stdout and stderr in one file
##PBS -l select=2:ncpus=32:ngpus=4:mpiprocs=4   # on a GPU queue (drop one '#' to use a line)
##PBS -q workq
##PBS -A myproject

set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Your software environment (a template: uncomment and adapt to your site):
# module load python/3.11 openmpi
# source "$HOME/venvs/mmm/bin/activate"     # a venv with `pip install -e '.[mpi]'` of this repository

# Ranks per host come from the nodefile's slots (mpiprocs), or the GPUs found on the host;
# --ppn overrides. MMM_MPI_FLAVOR=openmpi|hydra|pals if `mpiexec --version` is not recognised.
# export MMM_TIMEOUT=600                   # seconds a collective may wait for a slow or dead rank

echo "job ${PBS_JOBID:-?}: $(sort -u "$PBS_NODEFILE" | wc -l) host(s), $(wc -l < "$PBS_NODEFILE") slots"
launch python3 -m mmm.examples.fsdp_tp --tpsize 2 ${MMM_ARGS:-}
