"""Learning-rate schedules and held-out evaluation of the fsdp_tp trainer, on real runs: the logged
``lr`` against the formula, the same curve on every mesh, exact resume (the schedule comes back
from the step alone), refused resumes and flags, and ``--eval-every``'s ``val_loss`` across meshes.

Each configuration runs once per module (fixtures) and serves several tests.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest

from conftest import error_lines, jsonl, launch, max_rel_diff, run

TINY = [
    "-m",
    "mmm.examples.fsdp_tp",
    "--dim",
    "64",
    "--n-layers",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--no-plots",
    "--log-every",
    "100",
]
LR, MIN_LR, WARMUP, STEPS = 0.01, 0.001, 3, 10
SCHEDULE = ["--lr", str(LR), "--warmup-steps", str(WARMUP), "--min-lr", str(MIN_LR)]
COSINE = [*SCHEDULE, "--lr-schedule", "cosine"]
LINEAR = [*SCHEDULE, "--lr-schedule", "linear"]
EVAL = ["--eval-every", "3", "--eval-iters", "2", "--max-iters", "7"]
EVAL_STEPS = [3, 6, 7]  # every 3rd step and the last
TOL = 1e-5


# --------------------------------------------------------------------------- helpers
def command(n: int, *args: str) -> list[str]:
    return [sys.executable, *TINY, *args] if n == 1 else launch("-n", str(n), "python3", *TINY, *args)


def train(n: int, outdir: Path, *args: str, timeout: float = 240):
    res = run(command(n, *args, "--outdir", str(outdir)), timeout=timeout)
    assert res.returncode == 0, res.output
    return res


def history(outdir: Path) -> list[dict]:
    return jsonl(outdir / "history.jsonl", None)


def column(rows: list[dict], key: str) -> list:
    return [r[key] for r in rows]


def cosine_lr(step: int) -> float:
    """Written out here from the definition, not taken from mmm."""
    if step <= WARMUP:
        return LR * step / WARMUP
    t = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * t)) / 2


def linear_lr(step: int) -> float:
    if step <= WARMUP:
        return LR * step / WARMUP
    t = (step - WARMUP) / (STEPS - WARMUP)
    return LR - (LR - MIN_LR) * t


def assert_same_curve(rows: list[dict], ref: list[dict], *, tol: float = TOL) -> None:
    """Same steps; loss and grad_norm within tol (relative); the lr, a function of the step, identical."""
    assert column(rows, "iter") == column(ref, "iter")
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(column(rows, key), column(ref, key)) <= tol, (key, column(rows, key), column(ref, key))
    assert column(rows, "lr") == column(ref, "lr")


def copy_checkpoint(src: Path, step: int, dst: Path) -> Path:
    """One step's checkpoint alone in a fresh folder: a resume there cannot touch the original."""
    name = f"step-{step:08d}"
    shutil.copytree(src / name, dst / name)
    return dst


# --------------------------------------------------------------------------- runs (each once)
@pytest.fixture(scope="module")
def cosine1(tmp_path_factory):
    """1 process, cosine with warmup, 10 steps, a checkpoint at 5 (and 10): (outdir, checkpoint dir)."""
    out, ck = tmp_path_factory.mktemp("cosine1"), tmp_path_factory.mktemp("cosine1_ck")
    train(1, out, *COSINE, "--max-iters", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", "5")
    return out, ck


@pytest.fixture(scope="module")
def linear1(tmp_path_factory):
    out = tmp_path_factory.mktemp("linear1")
    train(1, out, *LINEAR, "--max-iters", str(STEPS))
    return out


@pytest.fixture(scope="module")
def constant1(tmp_path_factory):
    out = tmp_path_factory.mktemp("constant1")
    train(1, out, "--lr", str(LR), "--max-iters", str(STEPS))
    return out


EVAL_MESHES = {
    "1": (1, []),
    "dp2_tp2": (4, ["--tpsize", "2"]),
    "pp2_tp2": (4, ["--pp", "2", "--tpsize", "2"]),
    "cp2": (2, ["--cp", "2"]),
}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Cosine schedule with --eval-every 3 --eval-iters 2 over 7 steps on each mesh: {mesh: history}."""
    out = {}
    for name, (n, mesh) in EVAL_MESHES.items():
        d = tmp_path_factory.mktemp(f"eval_{name}")
        train(n, d, *COSINE, *EVAL, *mesh)
        out[name] = history(d)
    return out


@pytest.fixture(scope="module")
def not_evaluated(tmp_path_factory):
    """The 1-process run of `evaluated` without --eval-every."""
    d = tmp_path_factory.mktemp("eval_off")
    train(1, d, *COSINE, "--max-iters", "7")
    return history(d)


# --------------------------------------------------------------------------- 1. the schedule's values
def test_cosine_lr_is_warmup_then_cosine_to_min_lr(cosine1):
    rows = history(cosine1[0])
    assert column(rows, "iter") == list(range(1, STEPS + 1))
    for r in rows:
        assert abs(r["lr"] - cosine_lr(r["iter"])) <= 1e-12, (r["iter"], r["lr"], cosine_lr(r["iter"]))
    lrs = column(rows, "lr")
    assert lrs[WARMUP - 1] == pytest.approx(LR, abs=1e-12) and lrs[-1] == pytest.approx(MIN_LR, abs=1e-12)
    assert lrs[:WARMUP] == sorted(lrs[:WARMUP]) and lrs[WARMUP - 1 :] == sorted(lrs[WARMUP - 1 :], reverse=True)


def test_linear_lr_is_warmup_then_a_straight_line_to_min_lr(linear1):
    rows = history(linear1)
    assert column(rows, "iter") == list(range(1, STEPS + 1))
    for r in rows:
        assert abs(r["lr"] - linear_lr(r["iter"])) <= 1e-12, (r["iter"], r["lr"], linear_lr(r["iter"]))
    assert rows[-1]["lr"] == pytest.approx(MIN_LR, abs=1e-12)


def test_constant_is_the_default_and_gives_lr_on_every_step(constant1, cosine1, linear1):
    const = history(constant1)
    assert column(const, "iter") == list(range(1, STEPS + 1))
    assert column(const, "lr") == [LR] * STEPS
    cos, lin = history(cosine1[0]), history(linear1)
    # same weights and data: the first loss (before any update) is the same; after it the lr shows
    assert const[0]["loss"] == cos[0]["loss"] == lin[0]["loss"]
    for other in (cos, lin):
        assert max_rel_diff(column(other, "loss")[1:], column(const, "loss")[1:]) > 1e-3
    assert max_rel_diff(column(cos, "loss")[WARMUP + 1 :], column(lin, "loss")[WARMUP + 1 :]) > 1e-5


# --------------------------------------------------------------------------- 2. exact resume
def test_resume_continues_the_schedule_bit_for_bit(cosine1, tmp_path):
    ref = history(cosine1[0])
    ck = tmp_path / "ck"
    # a 5-step run of the 10-step schedule (its decay ends at 10, not at its own last step)
    train(
        1, tmp_path / "part", *COSINE, "--max-iters", "5", "--lr-decay-steps", str(STEPS), "--checkpoint-dir", str(ck)
    )
    part = history(tmp_path / "part")
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in part] == [
        (r["loss"], r["grad_norm"], r["lr"]) for r in ref[:5]
    ]
    out = tmp_path / "resumed"
    res = train(1, out, *COSINE, "--max-iters", str(STEPS), "--checkpoint-dir", str(ck), "--resume", "latest")
    assert "resumed from" in res.output and "step-00000005" in res.output, res.output
    rows = history(out)
    assert column(rows, "iter") == list(range(6, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert column(rows, key) == column(ref[5:], key), key


def test_resume_on_another_mesh_continues_the_schedule(cosine1, tmp_path):
    ck = copy_checkpoint(cosine1[1], 5, tmp_path / "ck")
    out = tmp_path / "resumed"
    res = train(
        4, out, *COSINE, "--max-iters", str(STEPS), "--tpsize", "2", "--checkpoint-dir", str(ck), "--resume", "latest"
    )
    assert "resumed from" in res.output and "step-00000005" in res.output, res.output
    assert_same_curve(history(out), history(cosine1[0])[5:])


# --------------------------------------------------------------------------- 3. another schedule: refused
@pytest.mark.parametrize(
    "flags, needle",
    [
        ([*COSINE, "--warmup-steps", "4"], "warmup_steps=3 (now 4)"),
        (LINEAR, "kind='cosine' (now 'linear')"),
        ([*COSINE, "--min-lr", "0.002"], "min_lr=0.001 (now 0.002)"),
        ([*COSINE, "--lr-decay-steps", "12"], "decay_steps=10 (now 12)"),
    ],
    ids=["warmup", "kind", "min_lr", "decay_steps"],
)
def test_resume_with_another_schedule_is_refused(cosine1, tmp_path, flags, needle):
    ck = copy_checkpoint(cosine1[1], 5, tmp_path / "ck")
    out = tmp_path / "out"
    res = run(
        command(
            1,
            *flags,
            "--max-iters",
            str(STEPS),
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "latest",
            "--outdir",
            str(out),
        ),
        timeout=120,
    )
    assert res.returncode == 2, res.output
    assert "Traceback" not in res.output, res.output
    lines = error_lines(res.stderr)
    assert len(lines) == 1, res.stderr
    assert "lr_schedule" in lines[0] and needle in lines[0] and "step-00000005" in lines[0], lines[0]
    assert not (out / "history.jsonl").exists() or not history(out)  # not one step trained
    assert sorted(p.name for p in ck.iterdir()) == ["step-00000005"]  # nothing saved over it


# --------------------------------------------------------------------------- 5. evaluation
@pytest.mark.parametrize("mesh", list(EVAL_MESHES))
def test_val_loss_at_every_nth_step_and_the_last(evaluated, mesh):
    rows = evaluated[mesh]
    assert column(rows, "iter") == list(range(1, 8))
    assert [r["iter"] for r in rows if "val_loss" in r] == EVAL_STEPS
    for r in rows:
        if r["iter"] not in EVAL_STEPS:
            assert not {"val_loss", "val_ppl", "dt_eval"} & set(r), r
            continue
        assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0, r
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12), r
        assert r["dt_eval"] > 0, r
        # held-out data: not the training batch of the step
        assert abs(r["val_loss"] - r["loss"]) / r["loss"] > 1e-3, r
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(set(vals)) == len(vals), vals  # the same batches each time, a model that moved


@pytest.mark.parametrize("mesh", [m for m in EVAL_MESHES if m != "1"])
def test_val_loss_and_training_are_the_same_on_every_mesh(evaluated, mesh):
    """The cosine schedule with warmup on dp 2 x tp 2, pp 2 x tp 2 and cp 2 gives one process's curve
    (loss, gradient norm, the same lr at every step) and held-out losses."""
    rows, ref = evaluated[mesh], evaluated["1"]
    assert_same_curve(rows, ref)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    ref_vals = [r["val_loss"] for r in ref if "val_loss" in r]
    assert max_rel_diff(vals, ref_vals) <= TOL, (vals, ref_vals)


def test_evaluation_does_not_change_training(evaluated, not_evaluated, cosine1):
    rows = evaluated["1"]
    assert not any("val_loss" in r for r in not_evaluated)
    for key in ("iter", "loss", "grad_norm", "lr"):
        assert column(rows, key) == column(not_evaluated, key), key
    # the first steps of the 10-step cosine run (whose decay differs only after the warmup) as well
    ten = history(cosine1[0])
    assert [r["loss"] for r in rows[: WARMUP + 1]] == [r["loss"] for r in ten[: WARMUP + 1]]


def test_evaluation_on_pydoc_text_holds_out_the_last_tenth(tmp_path):
    train(1, tmp_path, "--dataset", "pydoc", "--max-iters", "4", "--eval-every", "2", "--eval-iters", "2")
    rows = history(tmp_path)
    assert [r["iter"] for r in rows if "val_loss" in r] == [2, 4]
    for r in rows:
        if "val_loss" in r:
            assert math.isfinite(r["val_loss"]) and r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
            assert abs(r["val_loss"] - r["loss"]) / r["loss"] > 1e-3, r
