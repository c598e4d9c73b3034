#!/usr/bin/env bash
# Install, where this machine allows, what the real-launcher tests need beyond the virtual
# environment: a single-node Slurm (slurmctld, slurmd, srun/salloc/sbatch) and munge.
# Only as root with apt-get (Debian/Ubuntu), and only what is missing; a no-op otherwise.
# Never fails: when it cannot install, it says why and exits 0, and the Slurm tests skip
# with their own reason.
#   usage: scripts/test_deps.sh
#   env:   MMM_TEST_DEPS=0 skips it entirely
set -u
PATH="$PATH:/usr/sbin:/sbin"  # the daemons live in sbin, which a non-login PATH may lack

if [ "${MMM_TEST_DEPS:-1}" = "0" ]; then
  exit 0
fi

missing=()
for cmd in slurmctld slurmd srun salloc sbatch sinfo; do
  command -v "$cmd" >/dev/null 2>&1 || { missing+=(slurm-wlm); break; }
done
command -v munged >/dev/null 2>&1 || missing+=(munge)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0  # already installed: nothing to do (the quick path)
fi

why=""
if [ "${EUID:-$(id -u)}" != "0" ]; then
  why="not root"
elif ! command -v apt-get >/dev/null 2>&1; then
  why="no apt-get on this machine"
fi
if [ -n "$why" ]; then
  echo "test-deps: ${missing[*]} missing and not installed ($why); the Slurm tests will skip"
  exit 0
fi

echo "test-deps: installing ${missing[*]} with apt-get (for the real Slurm tests)"
export DEBIAN_FRONTEND=noninteractive
apt_install() {
  timeout 900 apt-get install -y -q -o DPkg::Lock::Timeout=300 --no-install-recommends "${missing[@]}" >/tmp/mmm-test-deps.log 2>&1
}
t0=$(date +%s)
if ! apt_install; then
  # stale or empty package lists: refresh once and retry
  timeout 300 apt-get update -q -o DPkg::Lock::Timeout=300 >>/tmp/mmm-test-deps.log 2>&1
  if ! apt_install; then
    echo "test-deps: apt-get install ${missing[*]} failed ($(grep -E '^(E|W):' /tmp/mmm-test-deps.log | tail -n 1)); see /tmp/mmm-test-deps.log; the Slurm tests will skip"
    exit 0
  fi
fi
echo "test-deps: installed ${missing[*]} in $(( $(date +%s) - t0 )) s"
exit 0
