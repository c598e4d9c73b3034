"""More than one host, for real: 2 hosts x 2 ranks on one machine (network namespaces, each with its own
address, hostname and node-local /tmp; see tests/hosts.py). Ranks on different hosts meet only over
the hosts' network, as on a cluster; the project tree is their shared filesystem.

- torchrun on each host (``--nnodes 2``), rank 0's host named by its hostname;
- ``launch`` under PBS (a ``PBS_NODEFILE`` naming both hosts) starting Open MPI's mpiexec on the first
  host, which reaches the second through a remote-shell agent exactly as it would through ssh;
- HSDP with its replicate axis across the two hosts gives one process's losses and gradient norms.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import BIN, clean_env, jsonl, kill_group, max_rel_diff, run
from mmm.dist import free_port

RANKS_PER_HOST = 2
TINY = "--dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --seq-len 32 --batch-size 8 --max-iters 4 --seed 5".split()


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
            ],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
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


def pbs_job(two_hosts, shared_dir, **extra: str) -> dict[str, str]:
    """The environment of a 2-node PBS job: a nodefile with a line per slot, the remote-shell agent for
    Open MPI's daemons (ssh on a real cluster)."""
    nodefile = shared_dir / "nodefile"
    nodefile.write_text("".join(f"{h}\n" for h in two_hosts.names for _ in range(RANKS_PER_HOST)))
    return clean_env(
        PBS_NODEFILE=str(nodefile), PBS_JOBID="4242.pbs", PRTE_MCA_plm_ssh_agent=str(two_hosts.agent()), **extra
    )


def test_launch_under_pbs_runs_mpiexec_across_two_hosts(two_hosts, shared_dir):
    out = shared_dir / "pbs-smoke"
    res = run(
        two_hosts.command(
            "node1", [str(BIN / "launch"), "python3", "-m", "mmm", "--tp", "2", "--report-dir", str(out)]
        ),
        env=pbs_job(two_hosts, shared_dir),
        timeout=120,
    )
    assert res.returncode == 0, res.output
    assert "launch: 4 ranks (2 per host) on 2 hosts via mpiexec (openmpi); scheduler: pbs" in res.stderr, res.stderr
    assert_two_hosts(reports(out), "launch/mpiexec")


def test_hsdp_replicas_on_two_hosts_match_one_process(two_hosts, shared_dir, tmp_path):
    """HSDP: each host holds one replica sharded over its 2 ranks; the replicate axis (gradient
    all-reduce) crosses the hosts. Loss and global gradient norm equal one process's."""
    ref = tmp_path / "one"
    res = run([sys.executable, "-m", "mmm.examples.fsdp_tp", *TINY, "--no-plots", "--outdir", str(ref)], timeout=120)
    assert res.returncode == 0, res.output
    out = shared_dir / "hsdp"
    cmd = [str(BIN / "launch"), "python3", "-m", "mmm.examples.fsdp_tp", *TINY, "--no-plots",
           "--strategy", "hsdp", "--dp-replicate", "2", "--outdir", str(out)]  # fmt: skip
    res = run(two_hosts.command("node1", cmd), env=pbs_job(two_hosts, shared_dir), timeout=180)
    assert res.returncode == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mesh"]["dp_replicate"] == 2 and summary["mesh"]["dp_shard"] == 2, summary["mesh"]
    for key in ("loss", "grad_norm"):
        one, two = jsonl(ref / "history.jsonl", key), jsonl(out / "history.jsonl", key)
        assert len(two) == 4 and max_rel_diff(two, one) <= 1e-5, (key, one, two)


@pytest.fixture
def shared_dir(two_hosts, request):
    """A folder every host sees at the same path (the hosts' /tmp is their own)."""
    d = two_hosts.state / "shared" / request.node.name
    d.mkdir(parents=True)
    return d
