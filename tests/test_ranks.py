"""Rank discovery, rendezvous and seeds from launcher environments (pure functions)."""

import socket

import pytest

from mmm.dist import (
    RankInfo,
    data_seed,
    derived_port,
    discover_ranks,
    free_port,
    parse_tasks_per_node,
    pick_device,
    rendezvous,
)
from mmm.errors import UsageError


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert discover_ranks(env) == RankInfo(5, 8, 1, 4, "torchrun")
    assert discover_ranks(env).num_nodes == 2


def test_a_world_size_without_a_rank_is_refused_not_run_as_one_process():
    """A script that exported WORLD_SIZE=2 but no RANK (a rank of its own to set, forgotten): every process
    would train alone as rank 0 of 1; refused naming both. WORLD_SIZE=1 is one process."""
    with pytest.raises(UsageError, match=r"^WORLD_SIZE=2 is set but RANK is not: set both"):
        discover_ranks({"WORLD_SIZE": "2"})
    assert discover_ranks({"WORLD_SIZE": "1"}) == RankInfo(0, 1, 0, 1, "single")


def test_openmpi_variables():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "12",
        "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "PMIX_RANK": "3",
    }
    info = discover_ranks(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.source) == (3, 12, 3, 4, "openmpi")
    assert info.num_nodes == 3


def test_mpich_hydra_and_cray_pals():
    hydra = {"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"}
    assert discover_ranks(hydra) == RankInfo(6, 8, 2, 4, "mpich")
    pals = {"PALS_RANKID": "13", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "1", "PMI_LOCAL_SIZE": "12", "PMI_RANK": "13"}
    assert discover_ranks(pals) == RankInfo(13, 24, 1, 12, "pals")


def test_torchrun_wins_over_mpi_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert discover_ranks(env).source == "torchrun"


def test_slurm_step_with_uneven_tasks_per_node():
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "9",
        "SLURM_STEP_NUM_TASKS": "11",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
    }
    assert discover_ranks(env) == RankInfo(9, 11, 1, 3, "slurm")


def test_slurm_batch_script_without_a_step_is_a_single_process():
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}
    assert discover_ranks(env) == RankInfo(0, 1, 0, 1, "single")


def test_no_launcher_is_a_single_process():
    assert discover_ranks({}) == RankInfo(0, 1, 0, 1, "single")


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert parse_tasks_per_node("8") == [8]


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 with WORLD_SIZE=4"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "0"}, "OMPI_COMM_WORLD_SIZE='0'"),
    ],
)
def test_malformed_variables_are_named(env, needle):
    with pytest.raises(UsageError, match=None) as e:
        discover_ranks(env)
    assert needle in str(e.value)


def test_pmix_without_sizes_or_mpi4py_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("MMM_NO_MPI4PY", "1")
    with pytest.raises(UsageError) as e:
        discover_ranks({"PMIX_RANK": "2"})
    assert "PMIX_RANK=2" in str(e.value) and "mpi4py" in str(e.value)


def test_rendezvous_honours_preset_address():
    info = RankInfo(1, 4, 1, 4, "torchrun")
    assert rendezvous(info, {"MASTER_ADDR": "node7", "MASTER_PORT": "29555"}) == ("node7", 29555)
    with pytest.raises(UsageError, match="MASTER_PORT='http'"):
        rendezvous(info, {"MASTER_ADDR": "node7", "MASTER_PORT": "http"})


def test_rendezvous_slurm_first_node_and_a_port_all_ranks_agree_on():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]"}
    a = rendezvous(RankInfo(0, 8, 0, 4, "slurm"), env)
    b = rendezvous(RankInfo(7, 8, 3, 4, "slurm"), env)
    assert a == b and a[0] == "gpu07" and 10000 <= a[1] < 30000
    assert a[1] == derived_port("4242.1")


def test_a_chosen_port_is_free_and_below_the_ports_the_kernel_gives_to_connections():
    # a port from the ephemeral range can be taken by any outgoing connection (gloo opens many)
    # between launch choosing it and rank 0 binding it: EADDRINUSE under load
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    if low < 2024:
        pytest.skip(f"the ephemeral range starts at {low}: too low to choose below it")
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    for p in ports:
        with socket.socket() as s:
            s.bind(("", p))  # free when chosen


def test_rendezvous_single_node_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setenv("MMM_NO_MPI4PY", "1")
    env = {"PMIX_NAMESPACE": "prterun-host-123@1"}
    assert rendezvous(RankInfo(2, 4, 2, 4, "openmpi"), env) == ("127.0.0.1", derived_port("prterun-host-123@1"))


def test_rendezvous_multi_node_without_any_hint_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MMM_NO_MPI4PY", "1")
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        rendezvous(RankInfo(2, 8, 2, 4, "openmpi"), {})


def test_data_seeds_never_collide_and_peers_share_streams():
    seeds = {data_seed(s, r) for s in range(50) for r in range(64)}
    assert len(seeds) == 50 * 64
    assert data_seed(7, 3) == data_seed(7, 3)


def test_unknown_and_missing_devices(monkeypatch):
    import torch

    with pytest.raises(UsageError, match="unknown device 'gpu'"):
        pick_device(0, "gpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the refusal of a missing one cannot be seen here")
    with pytest.raises(UsageError, match="device 'cuda' was requested but this machine has none"):
        pick_device(0, "cuda")
    monkeypatch.setenv("MMM_DEVICE", "cpu")
    assert pick_device(3).type == "cpu"


def test_srun_pmi2_uses_the_slurm_step_not_mpi():
    """srun --mpi=pmi2 exports PMI_RANK/PMI_SIZE but no MPI_LOCALRANKID: taking the MPICH path made
    local rank = global rank and started MPI through mpi4py (which hung on PMI-2)."""
    env = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "SLURM_PROCID": "3",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "7",
    }
    info = discover_ranks(env, use_mpi4py=False)
    assert (info.rank, info.world_size, info.local_rank, info.source) == (3, 4, 1, "slurm")
    # plain Hydra (MPICH/Intel MPI mpiexec) keeps its own variables
    hydra = discover_ranks(
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, use_mpi4py=False
    )
    assert hydra.source == "mpich" and hydra.local_rank == 1


def test_binding_an_mps_device_does_not_crash():
    """torch.mps has no set_device (Apple silicon crashed at setup); binding is a no-op there and on CPU."""
    import torch

    from mmm.dist.state import bind_device

    bind_device(torch.device("mps"))
    bind_device(torch.device("cpu"))


# --------------------------------------------------------------------------- many hosts
def test_pals_local_size_from_pals_local_size():
    """Cray PALS exports PALS_LOCAL_SIZE (PMI_LOCAL_SIZE is not always there): without reading it a
    multi-node job looked like one node and met at 127.0.0.1."""
    env = {"PALS_RANKID": "5", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "4", "PMI_RANK": "5"}
    info = discover_ranks(env, use_mpi4py=False)
    assert (info.local_rank, info.local_world_size, info.num_nodes, info.local_known) == (1, 4, 2, True)


def test_a_missing_local_size_is_unknown_not_one_node(monkeypatch):
    """An MPI that names rank and size but not the local layout (and no mpi4py to ask): the layout is
    unknown, so rendezvous never assumes every rank is on this host."""
    monkeypatch.setenv("MMM_NO_MPI4PY", "1")
    info = discover_ranks({"PMI_RANK": "2", "PMI_SIZE": "8"})
    assert (info.rank, info.world_size, info.source, info.local_known) == (2, 8, "mpich", False)
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        rendezvous(info, {"PMIX_NAMESPACE": "prterun-host-1@1"})  # before: ("127.0.0.1", port) on every node


def test_a_scripts_own_rank_variables_do_not_hide_the_slurm_step():
    """A job script that exports RANK/WORLD_SIZE (= the step's) must not make every rank local rank =
    global rank: SLURM_LOCALID says where it is (cyclic distribution here)."""
    step = {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}  # fmt: skip
    info = discover_ranks({**step, "RANK": "1", "WORLD_SIZE": "4"}, use_mpi4py=False)
    assert (info.source, info.local_rank, info.local_world_size) == ("slurm", 0, 2)
    # torchrun inside a Slurm step (its own ranks differ from the step's): torchrun's variables win
    tr = {**step, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert discover_ranks(tr, use_mpi4py=False) == RankInfo(5, 8, 1, 4, "torchrun")


def test_two_mpiexec_runs_in_one_pbs_job_never_share_a_derived_port(monkeypatch):
    """PBS_JOBID names the job, not the run: two mpiexec runs inside one job would meet at one port.
    Without a per-run key (PMIx namespace, PALS apid, Slurm step) or mpi4py, say how to fix instead."""
    monkeypatch.setenv("MMM_NO_MPI4PY", "1")
    with pytest.raises(UsageError, match="MASTER_ADDR"):
        rendezvous(RankInfo(1, 2, 1, 2, "mpich"), {"PBS_JOBID": "4242.pbs"})
    pals = rendezvous(RankInfo(1, 2, 1, 2, "pals"), {"PBS_JOBID": "4242.pbs", "PALS_APID": "a1"})
    assert pals == ("127.0.0.1", derived_port("a1"))


def _limit_files(soft: int, hard: int):
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_low_open_file_limit_is_raised_for_the_store():
    """Rank 0's store holds two connections per rank: a soft limit below that made ranks wait until the
    timeout (measured: a store host with 64 files accepted 25 clients). Setup raises the soft limit."""
    import subprocess

    from conftest import SCRIPTS, clean_env, launch, spawn

    cmd = launch("--launcher", "local", "-n", "2", "python3", str(SCRIPTS / "open_files.py"))
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_limit_files(64, 4096)) as p:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    softs = sorted(int(line.split()[3]) for line in out.splitlines() if line.startswith("rank "))
    assert softs == [2 * 2 + 512] * 2, out
    # a hard limit too low for the job: rank 0 says so in one line, at once
    with spawn(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               preexec_fn=_limit_files(64, 300)) as p:  # fmt: skip
        out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    assert "needs ~516 open files, but its hard limit is 300" in err and "Traceback" not in err, err


def test_rank_0s_host_under_slurm_is_the_steps_not_a_guess(tmp_path):
    """launch under srun exports only MASTER_PORT: each rank reads rank 0's host from the step (its first
    node; the first line of SLURM_HOSTFILE under --distribution=arbitrary, where tasks follow the file)."""
    step = {"SLURM_JOB_ID": "4", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "MASTER_PORT": "29400"}
    info = RankInfo(3, 4, 1, 2, "slurm")
    assert rendezvous(info, step) == ("n1", 29400)
    hosts = tmp_path / "hostfile"
    hosts.write_text("n2\nn2\nn1\nn1\n")
    arbitrary = {**step, "SLURM_DISTRIBUTION": "arbitrary", "SLURM_HOSTFILE": str(hosts)}
    assert rendezvous(info, arbitrary) == ("n2", 29400)
    del arbitrary["MASTER_PORT"]  # plain srun: the derived port, at the same host
    assert rendezvous(info, arbitrary) == ("n2", derived_port("4.0"))


def test_a_fault_on_a_rank_the_job_lacks_is_refused_but_not_after_a_relaunch(monkeypatch):
    """MMM_FAULT naming a rank the job does not have would never fire: refused at setup. After a relaunch
    (MMM_RESTART >= 1) faults do not fire at all, and a relaunch on fewer hosts has fewer ranks: not refused."""
    from mmm import faults

    monkeypatch.setenv("MMM_FAULT", "kill@3:3,nan@2")
    monkeypatch.delenv("MMM_RESTART", raising=False)
    assert faults.unreachable(4) == []
    (line,) = faults.unreachable(2)
    assert line.endswith(": kill@3:3 names a rank this job of 2 does not have"), line
    monkeypatch.setenv("MMM_RESTART", "1")
    assert faults.unreachable(2) == []
