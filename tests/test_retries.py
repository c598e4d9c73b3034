"""``launch --retries``: a job that loses a rank is relaunched in the same allocation and resumes from its
latest checkpoint; the result is the uninterrupted run's, step for step."""

from __future__ import annotations

import json

import pytest

from conftest import clean_env, jsonl, launch, run, tiny_llama

TINY = ["-m", "mmm.examples.fsdp_tp", *tiny_llama(batch_size=4), "--log-every", "100", "--max-iters", "8"]


@pytest.mark.parametrize("launcher", ["local", "mpiexec"])
def test_a_killed_rank_is_recovered_by_a_relaunch(tmp_path, launcher):
    ref = tmp_path / "ref"
    res = run(launch("--launcher", launcher, "-n", "2", "python3", *TINY, "--outdir", str(ref)), timeout=180)
    assert res.returncode == 0, res.output
    ck, out = tmp_path / "ck", tmp_path / "out"
    res = run(
        launch(
            "--launcher",
            launcher,
            "--retries",
            "2",
            "-n",
            "2",
            "python3",
            *TINY,
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--outdir",
            str(out),
        ),
        env=clean_env(MMM_FAULT="kill@5:1", MMM_TIMEOUT="60"),
        timeout=300,
    )
    assert res.returncode == 0, res.output
    assert (
        "launch: error: attempt 1 of 3 failed with exit code" in res.stderr
        and "relaunching (MMM_RESTART=1, fresh rendezvous port)" in res.stderr
    ), res.stderr
    assert "restart 1 (launch --retries): resuming from this run's newest checkpoint" in res.output
    assert "step-00000004" in res.output  # the last checkpoint of the first attempt
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in rows] == list(range(1, 9))  # one row per step: no duplicates, no gaps
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in rows], jsonl(ref / "history.jsonl", key)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (key, got, want)


def test_what_is_not_retried(tmp_path):
    # bad input fails the same way every time: one attempt, its own one-line error
    res = run(launch("--launcher", "local", "--retries", "3", "-n", "2", "python3", *TINY, "--tp", "3"), timeout=60)
    assert res.returncode == 2 and "relaunching" not in res.stderr, res.output
    # a job that keeps failing: every attempt is made, then its exit code
    res = run(
        launch("--launcher", "local", "--retries", "1", "-n", "1", "python3", "-c", "import sys; sys.exit(5)"),
        timeout=60,
    )
    assert res.returncode == 5 and "attempt 1 of 2 failed with exit code 5; relaunching" in res.stderr, res.output
    assert "attempt 2 of 2 failed with exit code 5; giving up" in res.stderr, res.output


def test_a_run_stopped_by_its_own_nan_check_is_not_retried(tmp_path):
    """A non-finite loss is deterministic: a relaunch from the last checkpoint would diverge again. The
    run exits 65 and launch stops there instead of replaying it N times."""
    res = run(
        launch("--launcher", "local", "--retries", "3", "-n", "2", "python3", *TINY,
               "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", "--outdir", str(tmp_path / "o")),
        env=clean_env(MMM_FAULT="nan@3"),
        timeout=120,
    )  # fmt: skip
    assert res.returncode == 65, res.output
    assert "loss is nan at iter 3" in res.stderr and "relaunching" not in res.stderr, res.output
