"""More than one host, for real: 2 hosts x 2 ranks on one machine (network namespaces, each with its own
address, hostname and node-local /tmp; see tests/hosts.py). Ranks on different hosts meet only over
the hosts' network, as on a cluster; the project tree is their shared filesystem.

- torchrun on each host (``--nnodes 2``), rank 0's host named by its hostname;
- ``launch`` under PBS (a ``PBS_NODEFILE`` naming both hosts) starting Open MPI's or MPICH's mpiexec on
  the first host, which reaches the second through a remote-shell agent exactly as it would through ssh;
- (tests/test_equivalence.py runs layouts across the two hosts: HSDP, a pipeline stage per host.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import BIN, clean_env, env_of, kill_group, mpi_env, pbs_job, run
from mmm.dist import free_port

RANKS_PER_HOST = 2


def reports(folder) -> list[dict]:
    found = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in found]


def assert_two_hosts(found: list[dict], launcher: str) -> None:
    assert [r["rank"] for r in found] == [0, 1, 2, 3], found
    assert [r["host"] for r in found] == ["node1", "node1", "node2", "node2"]  # ranks by host, in order
    assert [r["local_rank"] for r in found] == [0, 1, 0, 1]
    assert {(r["num_nodes"], r["local_world_size"]) for r in found} == {(2, 2)}
    assert {r["launcher"] for r in found} == {launcher}
    assert all(c["ok"] for r in found for c in r["checks"]), found
    assert {r["env_master"][0] for r in found} == {"node1"}  # rendezvous at rank 0's host, not 127.0.0.1


def test_torchrun_on_two_hosts(two_hosts, shared_dir):
    out = shared_dir / "torchrun"
    port = str(free_port())
    procs = [
        two_hosts.popen(
            host,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--nproc-per-node={RANKS_PER_HOST}",
                f"--node-rank={i}",
                "--master-addr=node1",
                f"--master-port={port}",
                "-m",
                "mmm",
                "--tp",
                "2",
                "--report-dir",
                str(out),
            ],  # fmt: skip
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i, host in enumerate(two_hosts.names)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "smoke test passed: 6 all-reduce checks on each of 4 ranks" in outs[0][0], outs[0]
    assert "world=4 nodes=2 local_world=2" in outs[0][0]
    assert_two_hosts(reports(out), "torchrun")


@pytest.mark.parametrize("flavor", ["openmpi", "mpich"])
def test_launch_under_pbs_runs_mpiexec_across_two_hosts(two_hosts, shared_dir, flavor):
    """launch on the first host of a 2-node PBS job: Open MPI's daemons and MPICH's Hydra proxies reach
    the second host through the remote-shell agent, as through ssh."""
    envdir = BIN.parent if flavor == "openmpi" else mpi_env(flavor)
    out = shared_dir / "report"
    cmd = [str(envdir / "bin" / "python"), "-m", "mmm.launch", "python3", "-m", "mmm", "--tp", "2",
           "--report-dir", str(out)]  # fmt: skip
    res = run(two_hosts.command("node1", cmd), env=pbs_job(two_hosts, shared_dir, PATH=env_of(envdir)["PATH"]))
    assert res.returncode == 0, res.output
    how = "openmpi" if flavor == "openmpi" else "hydra"
    assert f"launch: 4 ranks (2 per host) on 2 hosts via mpiexec ({how}); scheduler: pbs" in res.stderr, res.stderr
    assert_two_hosts(reports(out), "launch/mpiexec")
