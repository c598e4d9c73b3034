"""Checkpoint/resume across meshes, SIGKILL/SIGSTOP/SIGTERM, NaN losses: real ranks, real signals.

Faults are injected with MMM_FAULT (mmm.faults): the rank sends itself the real signal at a step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import (
    SCRIPTS,
    clean_env,
    jsonl,
    launch,
    max_rel_diff,
    mpiexec,
    on_ranks,
    run,
    spawn,
    torchrun,
    until_steps,
)
from mmm.errors import DIVERGED_EXIT

TINY = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--no-plots", "--log-every", "100"]
FSDP_TP = ["-m", "mmm.examples.fsdp_tp", *TINY]


def ranks(n: int, runner: str, args: list[str], **env: str) -> list[str]:
    if n == 1:
        return [sys.executable, *args]
    return (
        {"torchrun": torchrun, "mpiexec": mpiexec}[runner](n, *args)
        if runner != "launch"
        else launch("-n", str(n), "python3", *args)
    )


def ok(cmd, *, timeout=240, **env):
    res = run(cmd, env=clean_env(**env), timeout=timeout)
    assert res.returncode == 0, res.output
    return res


def test_exact_resume_same_mesh_and_history_continues(tmp_path):
    """6 steps straight vs 3 steps, stop, resume (under mpiexec): identical per-step losses."""
    full, ck = tmp_path / "full", tmp_path / "ck"
    ok(on_ranks(2, *FSDP_TP, "--max-iters", "6", "--outdir", str(full)))
    part = tmp_path / "part"
    ok(on_ranks(2, *FSDP_TP, "--max-iters", "3", "--checkpoint-dir", str(ck), "--outdir", str(part)))
    resumed = ok(
        mpiexec(
            2, *FSDP_TP, "--max-iters", "6", "--checkpoint-dir", str(ck), "--resume", "latest", "--outdir", str(part),
            "--measure",
        )
    )  # fmt: skip
    assert jsonl(part / "history.jsonl", "iter") == [1, 2, 3, 4, 5, 6]  # one record per step, no repeats
    assert jsonl(part / "history.jsonl") == jsonl(full / "history.jsonl")  # bit-identical in fp32
    summary = json.loads((part / "summary.json").read_text())
    assert summary["resumed_from"] == 3 and summary["steps"] == 6
    # --measure watches step 2, which this run never runs: its own second step instead (was: nothing measured)
    assert "this run starts at step 4, so it watches step 5" in resumed.output, resumed.output
    assert len(summary["measured_per_rank"]) == 2 and summary["measured_per_rank"][0]["comm_bytes"], summary


def test_resharding_resume_continues_the_same_curve(tmp_path):
    """Saved by one process -> resumed at dp=2; saved at tp=2 -> one process; saved at pp=2 -> dp=2, and
    -> pp=2 again (the optimizer's hyperparameters are saved by parameter name: in torch's nested form
    each stage's one param group had one key, written by one rank, and the other stage failed to load).
    (FSDP-sharded saves resumed elsewhere: test_every_trainer_resumes_on_another_mesh, the experts' and the
    schedule's resume tests.)"""
    full = tmp_path / "full"
    ck1 = tmp_path / "ck_one"
    ok(
        [sys.executable, *FSDP_TP, "--max-iters", "6", "--checkpoint-dir", str(ck1), "--checkpoint-every", "3"]
        + ["--outdir", str(full)]
    )
    reference = jsonl(full / "history.jsonl")[3:]
    cases = [
        (ck1, on_ranks(2, *FSDP_TP)),
        (tmp_path / "ck_tp2", [sys.executable, *FSDP_TP]),
        (tmp_path / "ck_pp2", on_ranks(2, *FSDP_TP)),
        (tmp_path / "ck_pp2", on_ranks(2, *FSDP_TP, "--pp", "2")),  # the same split: each stage its own groups
    ]
    for ck, layout in ((cases[1][0], ["--tp", "2"]), (cases[2][0], ["--pp", "2"])):
        out = tmp_path / f"o_{ck.name}"
        ok(on_ranks(2, *FSDP_TP, *layout, "--max-iters", "3", "--checkpoint-dir", str(ck), "--outdir", str(out)))
    for i, (ck, cmd) in enumerate(cases):
        out = tmp_path / f"resumed{i}"
        res = ok([*cmd, "--max-iters", "6", "--checkpoint-dir", str(ck), "--resume", "3", "--outdir", str(out)])
        assert "resumed from" in res.output
        assert jsonl(out / "history.jsonl", "iter") == [4, 5, 6]
        assert max_rel_diff(jsonl(out / "history.jsonl"), reference) <= 1e-5, (ck, jsonl(out / "history.jsonl"))


def test_deepspeed_checkpoint_resume_and_mesh_check(tmp_path):
    ck, out = tmp_path / "ck", tmp_path / "out"
    zero = [*FSDP_TP, "--strategy", "zero2"]
    ok(
        on_ranks(
            2, *zero, "--max-iters", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "3", "--outdir", str(out)
        )
    )
    assert (ck / "step-00000003" / "deepspeed").is_dir()
    res_out = tmp_path / "res"
    ok(on_ranks(2, *zero, "--max-iters", "6", "--checkpoint-dir", str(ck), "--resume", "3", "--outdir", str(res_out)))
    assert jsonl(res_out / "history.jsonl") == jsonl(out / "history.jsonl")[3:]
    res = run(
        [
            sys.executable,
            *zero,
            "--max-iters",
            "6",
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "3",
            "--outdir",
            str(tmp_path / "x"),
        ],
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    assert "same mesh" in res.stderr and "dp_shard" in res.stderr, res.stderr

    # the newest checkpoint damaged (a rank's optimizer states cut short): the one before it, with a warning
    (states,) = (ck / "step-00000006" / "deepspeed").rglob("zero_pp_rank_1_*optim_states.pt")
    os.truncate(states, 500)
    again = tmp_path / "again"
    res = ok(on_ranks(2, *zero, "--max-iters", "6", "--checkpoint-dir", str(ck), "--resume", "--outdir", str(again)))
    assert "step 6 in" in res.output and "is damaged" in res.output and "is not a whole torch file" in res.output
    assert jsonl(again / "history.jsonl") == jsonl(out / "history.jsonl")[3:]


@pytest.mark.parametrize(
    "example, flags",
    [
        ("vit", ["--depth", "2", "--max-iters", "4"]),
        ("fsdp", ["--epochs", "2", "--steps-per-epoch", "2"]),  # resumes at an epoch boundary (lr decayed)
    ],
)
def test_every_trainer_resumes_on_another_mesh(tmp_path, example, flags):
    full, ck = tmp_path / "full", tmp_path / "ck"
    args = ["-m", f"mmm.examples.{example}", *flags, "--no-plots"]
    ok(
        launch(
            "-n", "2", "python3", *args, "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--outdir", str(full)
        )
    )
    out = tmp_path / "resumed"
    ok([sys.executable, *args, "--checkpoint-dir", str(ck), "--resume", "2", "--outdir", str(out)])
    assert max_rel_diff(jsonl(out / "history.jsonl"), jsonl(full / "history.jsonl")[2:]) <= 1e-5


def test_incompatible_checkpoint_keep_last_and_partial_saves(tmp_path):
    ck = tmp_path / "ck"
    ok(
        [
            sys.executable,
            *FSDP_TP,
            "--max-iters",
            "5",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "1",
            "--keep-last",
            "2",
            "--outdir",
            str(tmp_path / "a"),
        ]
    )
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000004", "step-00000005"]
    # what a crash mid-save leaves behind is never taken for a checkpoint
    (ck / ".step-00000009.tmp").mkdir()
    (ck / "step-00000010").mkdir()  # no mmm.json: incomplete
    res = run(
        [
            sys.executable,
            *FSDP_TP,
            "--dim",
            "32",
            "--max-iters",
            "6",
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "latest",
            "--outdir",
            str(tmp_path / "b"),
        ],
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    line = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(line) == 1 and "step-00000005" in line[0] and "dim=64 (now 32)" in line[0], res.stderr
    res = ok(
        [
            sys.executable,
            *FSDP_TP,
            "--max-iters",
            "6",
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "latest",
            "--outdir",
            str(tmp_path / "c"),
        ]
    )
    assert "resumed from" in res.output and "step-00000005" in res.output


@pytest.mark.parametrize("runner", ["torchrun", "mpiexec"])
def test_sigkill_of_a_rank_stops_the_others_naming_it(tmp_path, runner):
    res = run(
        ranks(3, runner, [*FSDP_TP, "--batch-size", "12", "--max-iters", "20", "--outdir", str(tmp_path)]),
        env=clean_env(MMM_FAULT="kill@3:1", MMM_TIMEOUT="300"),
        timeout=120,
    )
    assert res.returncode != 0
    assert res.seconds < 60, res.seconds
    # the surviving ranks name it, or mpiexec does when it stops them first
    assert "rank 1 stopped answering" in res.stderr or "process rank 1" in res.stderr, res.stderr
    assert "[rank 0] Traceback" not in res.stderr and "[rank 2] Traceback" not in res.stderr
    assert jsonl(tmp_path / "history.jsonl", "iter")[:2] == [1, 2]  # the finished steps are on disk


# under torchrun the same holds, but torchrun waits 30 s before it SIGKILLs the stopped worker (~50 s in all).
# ZeRO: DeepSpeed reduces over a group it makes itself (torch gives it 30 min), held to the job's timeout too
@pytest.mark.parametrize("runner, strategy", [("mpiexec", "fsdp"), ("mpiexec", "zero2")], ids=["fsdp", "zero2"])
def test_a_stalled_rank_fails_the_others_after_the_timeout(tmp_path, runner, strategy):
    timeout = 8
    flags = ["--batch-size", "12", "--max-iters", "20", "--timeout", str(timeout), "--strategy", strategy]
    res = run(
        ranks(3, runner, [*FSDP_TP, *flags, "--outdir", str(tmp_path)]),
        env=clean_env(MMM_FAULT="stop@3:2"),
        timeout=150,
    )
    assert res.returncode != 0
    assert res.seconds < timeout + 60, res.seconds
    assert "collective timeout (8 s" in res.stderr and "rank 2 stopped answering" in res.stderr, res.stderr
    # where the live ranks were: rank 0's message points to the stack files, each names the step's code
    assert f"where each live rank was: {tmp_path / 'stacks'}/rank-*.txt" in res.stderr, res.stderr
    for rank in (0, 1):
        stacks = (tmp_path / "stacks" / f"rank-{rank}.txt").read_text()
        assert "roll call after a failed collective" in stacks and "fsdp_tp.py" in stacks, stacks


def test_a_collective_stuck_on_a_mesh_axis_fails_within_the_job_timeout():
    """torch gives each new group (a mesh axis's) 30 minutes; mmm holds them to the job's timeout (4 s)."""
    res = run(on_ranks(4, str(SCRIPTS / "ep_no_tokens.py"), "stall"), timeout=90)
    assert res.returncode == 0, res.output
    seconds = float(res.stdout.split("the stuck collective failed after ")[1].split()[0])
    assert 3 < seconds < 10, res.stdout  # its peers stay 14 s: torch's own 30 min would fail at 14


@pytest.mark.parametrize("runner", ["torchrun", "mpiexec"])
def test_sigterm_finishes_the_step_saves_and_exits_cleanly(tmp_path, runner):
    ck, out = tmp_path / "ck", tmp_path / "out"
    res = run(
        ranks(2, runner, [*FSDP_TP, "--max-iters", "20", "--checkpoint-dir", str(ck), "--outdir", str(out)]),
        env=clean_env(MMM_FAULT="term@3:1"),
        timeout=120,
    )  # only rank 1 is signalled
    assert res.returncode == 0, res.output
    # step 3 is not a logging step (--log-every 100), so its values (the SIGTERM flag among them) are
    # read at the end of step 4: every rank stops after step 4, together, and saves it
    assert [p.name for p in ck.iterdir()] == ["step-00000004"]
    assert jsonl(out / "history.jsonl", "iter") == [1, 2, 3, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and (out / "history.nc").is_file()
    for rank in summary["memory_per_rank"]:  # measured with gradients, though the run never reached its last step
        assert rank["grad_bytes"] == rank["param_bytes"] > 0 and rank["optim_bytes"] == 2 * rank["param_bytes"], rank


def _signal_a_training_job(launcher: str, out, sig: signal.Signals, *flags: str, group=False) -> tuple[int, str]:
    """launch a 2-rank run that would train for ever, ``sig`` to launch (``group``: to its whole process group,
    as ``timeout`` sends it) after its 3rd step: exit code, stderr."""
    cmd = launch("--launcher", launcher, "-n", "2", "python3", *FSDP_TP, "--max-iters", "100000", *flags, "--outdir",
                 str(out))  # fmt: skip
    with spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:  # a session of its own: no terminal's
        until_steps(out / "history.jsonl", 3, p)
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    return p.returncode, err


@pytest.mark.parametrize("launcher, group", [("local", False), ("mpiexec", False), ("mpiexec", True)],
                         ids=["local", "mpiexec", "mpiexec-to-the-group"])  # fmt: skip
def test_sigterm_to_launch_preempts_the_job_gracefully(tmp_path, launcher, group):
    """SIGTERM to launch: every rank finishes its step and saves, exit 0. Under Open MPI launch sends it to the
    ranks itself (prterun would SIGKILL them within a second of passing it on), also when the signal goes to
    launch's whole process group (``timeout``: prterun runs in a group of its own), and a Ctrl-C ends the job
    with 130, without Open MPI's box."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    code, err = _signal_a_training_job(launcher, out, signal.SIGTERM, "--checkpoint-dir", str(ck), group=group)
    assert code == 0, err
    steps = jsonl(out / "history.jsonl", "iter")
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert [q.name for q in ck.iterdir()] == [f"step-{steps[-1]:08d}"]
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"
    if launcher == "mpiexec" and not group:
        code, err = _signal_a_training_job(launcher, tmp_path / "int", signal.SIGINT)
        assert code == 130 and "prterun detected" not in err, (code, err)


def test_nonfinite_loss_or_gradient_stops_naming_the_step_and_the_last_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    res = run(
        on_ranks(
            2,
            *FSDP_TP,
            "--max-iters",
            "8",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--outdir",
            str(tmp_path / "a"),
        ),
        env=clean_env(MMM_FAULT="nan@5"),
        timeout=120,
    )
    assert res.returncode == DIVERGED_EXIT, res.output  # launch passes the ranks' own code on
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "loss is nan at iter 5" in errors[0] and "step-00000004" in errors[0], res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000002", "step-00000004"]
    assert jsonl(tmp_path / "a" / "history.jsonl", "iter") == [1, 2, 3, 4, 5]
    # a finite loss with a NaN gradient on one rank: stopped all the same, before step 3 is saved (it was
    # applied, saved and named the last good checkpoint)
    ck = tmp_path / "ck_grad"
    res = run(
        on_ranks(2, *FSDP_TP, "--max-iters", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
                 "--outdir", str(tmp_path / "c")),
        env=clean_env(MMM_FAULT="nangrad@3:1"),
        timeout=120,
    )  # fmt: skip
    errors = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert res.returncode == DIVERGED_EXIT and len(errors) == 1, res.output
    assert "the gradient norm is nan (loss " in errors[0] and "at iter 3" in errors[0] and "step-00000002" in errors[0]
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000001", "step-00000002"]
    res = ok(
        on_ranks(2, *FSDP_TP, "--max-iters", "8", "--on-nonfinite", "skip", "--outdir", str(tmp_path / "b")),
        MMM_FAULT="nan@5,nangrad@7:1",
    )
    rows = jsonl(tmp_path / "b" / "history.jsonl", None)
    assert [r["skipped"] for r in rows] == [0, 0, 0, 0, 1, 0, 1, 0]  # rank 0 skips rank 1's NaN gradient too
    assert all(r["loss"] == r["loss"] and r["grad_norm"] == r["grad_norm"] for r in rows if not r["skipped"])


@pytest.mark.parametrize("module", ["mmm.examples.fsdp_tp", "mmm.examples.vit", "mmm.examples.fsdp"])
def test_bare_resume_means_latest(module):
    import importlib

    parser = importlib.import_module(module).build_parser()
    assert parser.parse_args(["--checkpoint-dir", "c", "--resume"]).resume == "latest"
    assert parser.parse_args(["--checkpoint-dir", "c", "--resume", "4"]).resume == "4"
    assert parser.parse_args([]).resume is None
