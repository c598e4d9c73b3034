#!/bin/bash
# Train the FSDP x TP example on Aurora-style nodes (PBS Pro + HPE PALS mpiexec, Intel GPUs):
# 12 GPU tiles per node (each its own xpu device in the default FLAT mode), one rank per tile;
# `launch` reads $PBS_NODEFILE and builds the PALS mpiexec line (-n, --ppn, --hostfile, --env ...).
#
#   qsub examples/jobs/aurora.sh
#   qsub -v MMM_ARGS="--max-iters 200" examples/jobs/aurora.sh      # extra trainer flags
#
#PBS -N mmm-fsdp-tp
#PBS -l select=2                         # hosts
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:flare           # the filesystems the job reads and writes
#PBS -j oe
##PBS -q debug
##PBS -A myproject

set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"

# Your software environment (a template: uncomment and adapt to your site):
# module load frameworks                    # torch with XPU support and oneCCL
# source "$HOME/venvs/mmm/bin/activate"     # a venv (--system-site-packages) with `pip install -e '.[xpu]'`

export MMM_DEVICE=xpu            # one Intel GPU tile per rank (local rank -> xpu:N)
export MMM_GPUS_PER_NODE=12      # ranks per node: the tiles (launch's --ppn overrides)
export MMM_MPI_FLAVOR=pals       # Aurora's mpiexec is HPE PALS
# The backend is xccl (torch's own) or oneCCL's "ccl"; oneCCL settings that are common there:
# export CCL_PROCESS_LAUNCHER=pmix CCL_ATL_TRANSPORT=mpi
# export FI_PROVIDER=cxi
# export MMM_TIMEOUT=600                   # seconds a collective may wait for a slow or dead rank

echo "job ${PBS_JOBID:-?}: $(sort -u "$PBS_NODEFILE" | wc -l) host(s)"
# CPU binding: extra mpiexec flags go through --mpi-args.
launch --mpi-args "--cpu-bind list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100" \
  python3 -m mmm.examples.fsdp_tp --tpsize 2 ${MMM_ARGS:-}
