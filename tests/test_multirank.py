"""Real ranks on CPU/gloo under torchrun, mpiexec and `launch`: discovery, mesh membership, smoke test."""

import json
import sys

from conftest import SCRIPTS, clean_env, launch, mpiexec, run, torchrun

# Hand-computed rank lists. Axis order pp, dp_replicate, dp_shard, cp, tp (tp innermost).
EXPECTED = {
    # 4 ranks, tp=2 -> dp_shard=2: rank = dp_shard*2 + tp
    ("--tp", "2"): {
        "world": [[0, 1, 2, 3]],
        "tp": [[0, 1], [2, 3]],
        "dp_shard": [[0, 2], [1, 3]],
        "dp": [[0, 2], [1, 3]],
    },
    # 8 ranks, pp=2 dp_replicate=2 tp=2 (dp_shard=1): rank = pp*4 + dp_replicate*2 + tp
    ("--pp", "2", "--dp-replicate", "2", "--tp", "2"): {
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_replicate": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    },
    # 8 ranks, dp_replicate=2 dp_shard=2 tp=2: rank = r*4 + s*2 + t
    ("--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"): {
        "dp_replicate": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "dp_shard": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
    # 8 ranks, dp_shard=2 cp=2 tp=2: rank = s*4 + c*2 + t
    ("--cp", "2", "--tp", "2"): {
        "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "dp_shard_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    },
}


def _reports(tmp_path, n):
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    assert [r["rank"] for r in reports] == list(range(n))
    return reports


def _check_groups(reports, expected):
    for name, groups in expected.items():
        for rep in reports:
            mine = [g for g in groups if rep["rank"] in g]
            assert len(mine) == 1
            assert rep["groups"][name] == mine[0], (name, rep["rank"], rep["groups"][name])
    for rep in reports:
        assert all(c["ok"] for c in rep["checks"]), rep["checks"]


def _run_smoke(cmd_for, n, mesh_args, tmp_path, env=None, timeout=120):
    res = run(cmd_for(n, "-m", "mmm", *mesh_args, "--report-dir", str(tmp_path)), env=env, timeout=timeout)
    assert res.returncode == 0, res.output
    assert "smoke test passed" in res.stdout
    reports = _reports(tmp_path, n)
    _check_groups(reports, EXPECTED[tuple(mesh_args)])
    return res, reports


def test_torchrun_4_ranks_tp2(tmp_path):
    res, reports = _run_smoke(torchrun, 4, ["--tp", "2"], tmp_path)
    assert {r["launcher"] for r in reports} == {"torchrun"}
    assert [r["coordinates"]["tp"] for r in reports] == [[0, 2], [1, 2], [0, 2], [1, 2]]
    assert reports[3]["coordinate_line"].endswith("[3/3][pp:0/0][dp:1/1][tp:1/1]")
    assert "initializing tensor parallel with size 2" in res.stdout


def test_mpiexec_4_ranks_tp2_rendezvous_over_mpi4py(tmp_path):
    _, reports = _run_smoke(mpiexec, 4, ["--tp", "2"], tmp_path)
    assert {r["launcher"] for r in reports} == {"openmpi"}
    assert sorted(r["local_rank"] for r in reports) == [0, 1, 2, 3]  # Open MPI may map them in any order
    assert len({tuple(r["env_master"]) for r in reports}) == 1  # one rendezvous, shared over MPI


def test_mpiexec_without_mpi4py_uses_the_job_namespace(tmp_path):
    _, reports = _run_smoke(mpiexec, 4, ["--tp", "2"], tmp_path, env=clean_env(MMM_NO_MPI4PY="1"))
    assert {r["env_master"][0] for r in reports} == {"127.0.0.1"}


def test_launch_local_8_ranks_pp_dp_replicate_tp(tmp_path):
    def cmd(n, *args):
        return launch("--launcher", "local", "-n", str(n), "python3", *args)

    _, reports = _run_smoke(cmd, 8, ["--pp", "2", "--dp-replicate", "2", "--tp", "2"], tmp_path, timeout=180)
    assert {r["launcher"] for r in reports} == {"launch/local"}
    assert [r["coordinates"]["pp"][0] for r in reports] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_launch_mpiexec_8_ranks_hsdp_tp(tmp_path):
    def cmd(n, *args):
        return launch("-n", str(n), "python3", *args)

    _, reports = _run_smoke(cmd, 8, ["--dp-replicate", "2", "--dp-shard", "2", "--tp", "2"], tmp_path, timeout=180)
    assert {r["launcher"] for r in reports} == {"launch/mpiexec"}


def test_torchrun_8_ranks_cp_tp(tmp_path):
    """cp's group also carries an all-to-all (all-to-all context parallel's, as ep's carries the experts')."""
    res, reports = _run_smoke(torchrun, 8, ["--cp", "2", "--tp", "2"], tmp_path, timeout=180)
    for rep in reports:
        (a2a,) = [c for c in rep["checks"] if c.get("kind") == "all-to-all"]
        assert a2a["name"] == "cp" and a2a["members"] == rep["groups"]["cp"] and a2a["ok"], a2a
    assert "all-to-all over cp           size 2: ok" in res.output, res.output


def test_two_ranks_and_all_ranks_logging(tmp_path):
    res = run(torchrun(2, "-m", "mmm"), env=clean_env(LOG_FROM_ALL_RANKS="1"))
    assert res.returncode == 0, res.output
    assert "[r0] [" in res.stdout and "[r1] [" in res.stdout  # each rank's coordinate line


def test_single_process_needs_no_launcher():
    res = run([sys.executable, "-m", "mmm"])
    assert res.returncode == 0, res.output
    assert "launcher=single world=1" in res.stdout


def test_dp_ranks_draw_their_own_random_numbers_tp_peers_the_same():
    """Dropout masks: one stream per dp rank (they were all the same), shared by TP peers."""
    import ast

    res = run(launch("-n", "4", "python3", str(SCRIPTS / "rng_streams.py")), timeout=90)
    assert res.returncode == 0, res.output
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("[("))
    draws = {(dp, tp): tuple(x) for dp, tp, x in ast.literal_eval(line)}
    assert draws[(0, 0)] == draws[(0, 1)] and draws[(1, 0)] == draws[(1, 1)]
    assert draws[(0, 0)] != draws[(1, 0)]
