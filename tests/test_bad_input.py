"""Bad input across every trainer and `launch`: one line naming the value, non-zero exit, fast, no traceback.

Trainers run on 2 ranks under `launch --launcher local`, which stops the job at the first rank's
exit and returns its code: rank 0 reports the problem once, every rank exits non-zero.
"""

from __future__ import annotations

import sys

import pytest

from conftest import clean_env, launch, run

FILE = "<file>"  # replaced by a path that is a file
CKPT = "<ckpt>"  # replaced by a folder holding a checkpoint of a (different) fsdp_tp model
EMPTY = "<empty>"  # replaced by an empty folder

TRAINER_CASES = [
    # (trainer, flags, env, words the error line must contain)
    ("fsdp_tp", ["--tp", "3"], {}, ["tp=3", "valid tp"]),
    ("fsdp_tp", ["--batch-size", "7"], {}, ["--batch-size 7"]),
    ("fsdp_tp", ["--pp", "2", "--n-layers", "3"], {}, ["--n-layers 3"]),
    ("fsdp_tp", ["--pp", "2", "--microbatches", "3"], {}, ["--microbatches 3"]),
    ("fsdp_tp", ["--cp", "2", "--seq-len", "30"], {}, ["30"]),
    ("fsdp_tp", ["--outdir", FILE], {}, [FILE]),
    ("fsdp_tp", ["--checkpoint-dir", FILE + "/sub"], {}, [FILE]),
    ("fsdp_tp", ["--checkpoint-dir", EMPTY, "--resume", "7"], {}, ["--resume 7", "none"]),
    ("fsdp_tp", ["--dim", "128", "--checkpoint-dir", CKPT, "--resume", "latest"], {}, ["dim=64 (now 128)"]),
    ("fsdp_tp", ["--timeout", "0"], {}, ["--timeout 0"]),
    ("fsdp_tp", ["--strategy", "zero1", "--on-nonfinite", "skip"], {}, ["--on-nonfinite skip", "zero1"]),
    ("fsdp_tp", [], {"MMM_DEVICE": "cuda"}, ["cuda"]),
    ("fsdp_tp", [], {"MMM_FAULT": "boom@3"}, ["boom@3"]),
    ("fsdp", ["--batch-size", "5"], {}, ["--batch-size 5"]),
    ("fsdp", ["--dropout", "1.5"], {}, ["--dropout 1.5"]),
    ("fsdp", ["--data-dir", EMPTY + "/missing"], {}, ["missing"]),
    ("vit", ["--num-heads", "3", "--tp", "2"], {}, ["3"]),
    ("vit", ["--checkpoint-dir", CKPT, "--resume", "latest"], {}, ["does not fit this run"]),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    f = root / "a_file"
    f.write_text("x")
    empty = root / "empty"
    empty.mkdir()
    ckpt = root / "ckpt"
    res = run(
        [
            sys.executable,
            "-m",
            "mmm.examples.fsdp_tp",
            "--dim",
            "64",
            "--n-layers",
            "2",
            "--seq-len",
            "32",
            "--max-iters",
            "1",
            "--no-plots",
            "--checkpoint-dir",
            str(ckpt),
            "--outdir",
            str(root / "o"),
        ]
    )
    assert res.returncode == 0, res.output
    return {FILE: str(f), CKPT: str(ckpt), EMPTY: str(empty)}


def _fill(items, paths):
    out = []
    for x in items:
        for key, value in paths.items():
            x = x.replace(key, value)
        out.append(x)
    return out


def assert_one_clean_line(res, needles):
    assert res.returncode != 0, res.output
    assert res.seconds < 30, res.seconds
    assert "Traceback" not in res.output, res.output
    lines = [ln for ln in res.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, res.stderr  # reported once, by rank 0
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.mark.parametrize(
    "trainer, flags, env, needles",
    TRAINER_CASES,
    ids=[f"{t}:{' '.join(f) or next(iter(e), '')}" for t, f, e, _ in TRAINER_CASES],
)
def test_trainer_bad_input(paths, trainer, flags, env, needles):
    base = {
        "fsdp_tp": ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--max-iters", "4"],
        "fsdp": ["--epochs", "1", "--steps-per-epoch", "2"],
        "vit": ["--depth", "2", "--max-iters", "4"],
    }[trainer]
    # the case's flags come last, so they win over the small defaults
    cmd = launch(
        "--launcher",
        "local",
        "-n",
        "2",
        "python3",
        "-m",
        f"mmm.examples.{trainer}",
        "--no-plots",
        *base,
        *_fill(flags, paths),
    )
    res = run(cmd, env=clean_env(**env), timeout=60)
    assert_one_clean_line(res, _fill(needles, paths))


LAUNCH_CASES = [
    (["-n", "0", "python3", "-c", "pass"], ["-n", "0"]),
    (["--launcher", "pbs", "-n", "2", "python3", "-c", "pass"], ["pbs"]),
    (["--hostfile", "/no/such/hostfile", "-n", "2", "python3", "-c", "pass"], ["/no/such/hostfile"]),
    (["-n", "2"], ["command"]),
]


@pytest.mark.parametrize("flags, needles", LAUNCH_CASES, ids=[" ".join(f[:2]) for f, _ in LAUNCH_CASES])
def test_launch_bad_input(flags, needles):
    res = run(launch(*flags), timeout=60)
    assert_one_clean_line(res, needles)


def test_launch_of_a_missing_script_fails_fast_without_traceback():
    res = run(launch("--launcher", "local", "-n", "2", "python3", "/no/such/script.py"), timeout=60)
    assert res.returncode != 0 and res.seconds < 30, res.output
    assert "Traceback" not in res.output and "/no/such/script.py" in res.stderr, res.output


def test_flag_checks_in_process():
    """The checks behind the table, without processes: each message names the value and a fix."""
    from mmm.cli import FLAGS
    from mmm.errors import UsageError
    from mmm.faults import parse
    from mmm.parallel.checkpoint_folder import checkpoint_problems

    # the library names its arguments; the trainers pass FLAGS to name their flags
    assert checkpoint_problems(None, "latest", 0, 0) == [
        "resume='latest' needs checkpoint_dir (the folder holding step-NNNNNNNN checkpoints)"
    ]
    assert checkpoint_problems(None, "latest", 0, 0, spell=FLAGS) == [
        "--resume latest needs --checkpoint-dir (the folder holding step-NNNNNNNN checkpoints)"
    ]
    assert any("'soon'" in p for p in checkpoint_problems("ck", "soon", 0, 0))
    assert any("--keep-last -1" in p for p in checkpoint_problems("ck", None, 0, -1, spell=FLAGS))
    assert parse("kill@5:1, nan@7") == {5: [("kill", 1)], 7: [("nan", None)]}
    with pytest.raises(UsageError, match="'kill@x'"):
        parse("kill@x")
