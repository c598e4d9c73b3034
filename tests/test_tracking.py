"""Trackers (--wandb, --tensorboard) read back with their own readers and compared with history.jsonl;
a missing extra stops every rank; --rank-timings names a slow rank; the closing table and report.md."""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from conftest import SCRIPTS, clean_env, jsonl, launch, run

TINY = ["--dim", "64", "--n-layers", "2", "--seq-len", "32", "--batch-size", "4"]


# --------------------------------------------------------------------------- readers
def wandb_records(run_dir: Path) -> list:
    """Every record of an offline W&B run's ``.wandb`` file, parsed with wandb's own protobuf classes.

    The file is a LevelDB-style log (wandb's transaction log): a 7-byte header (``:W&B``, 0xBEE1,
    version 0), then 32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1) | data``; type
    1 is a whole record, 2/3/4 the first/middle/last piece of one."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    block, pos, pieces, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        pos += 7 + length
        pieces += chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pieces)
            out.append(rec)
            pieces = b""
    return out


def wandb_history(records) -> dict[int, dict]:
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            rows[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def wandb_config(records) -> dict:
    (first,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    return {(i.key or ".".join(i.nested_key)): json.loads(i.value_json) for i in first.config.update}


def wandb_exit_code(records) -> int:
    (code,) = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    return code


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def the_run_dir(base: Path) -> Path:
    (d,) = (base / "wandb").glob("offline-run-*")
    return d


def trainer(n: int, outdir: Path, *flags: str, env=None, script=None, timeout: float = 120):
    cmd = [script] if script else ["-m", "mmm.examples.fsdp_tp"]
    return run(
        launch("-n", str(n), "python3", *cmd, *TINY, *flags, "--outdir", str(outdir)),
        env=env or clean_env(WANDB_MODE="offline"),
        timeout=timeout,
    )


# --------------------------------------------------------------------------- end to end
def test_wandb_and_tensorboard_hold_every_history_row(tmp_path):
    """Every History row reaches both trackers with its step; the config holds the flags and the mesh;
    the closing table is printed (plain), report.md written beside summary.json."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    res = trainer(
        2,
        tmp_path,
        "--max-iters",
        "4",
        "--wandb",
        "--wandb-project",
        "mmm-tests",
        "--wandb-name",
        "tiny",
        "--tensorboard",
        "--rank-timings",
        "--eval-every",
        "2",
        "--no-plots",
    )
    assert res.returncode == 0, res.output
    hist = jsonl(tmp_path / "history.jsonl", key=None)
    assert [r["iter"] for r in hist] == [1, 2, 3, 4]

    records = wandb_records(the_run_dir(tmp_path))
    logged = wandb_history(records)
    assert sorted(logged) == [1, 2, 3, 4]
    for row in hist:  # the same numbers (JSON both ways), every key
        assert logged[row["iter"]] == {k: v for k, v in row.items() if k != "iter"}, row["iter"]
    config = wandb_config(records)
    assert config["max_iters"] == 4 and config["dim"] == 64 and config["example"] == "fsdp_tp"
    assert config["eval_every"] == 2 and config["eval_iters"] == 4  # the batches an evaluation ran, not null
    assert config["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1}
    assert wandb_exit_code(records) == 0
    (run_rec,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_rec.project, run_rec.display_name) == ("mmm-tests", "tiny")

    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    for key in ("loss", "dt", "dtf", "dtb", "tps", "grad_norm", "dt_max", "slowest_rank"):
        assert sorted(scalars[key]) == [1, 2, 3, 4], key
        for row in hist:  # TensorBoard keeps float32
            assert scalars[key][row["iter"]] == pytest.approx(row[key], rel=1e-6), (key, row["iter"])

    for row in hist:  # --rank-timings on every step (--log-every 1)
        assert row["dt_min"] <= row["dt"] <= row["dt_max"] and row["slowest_rank"] in (0, 1)
        assert row["dt_min"] <= row["dt_mean"] <= row["dt_max"] and row["dt_lag"] >= 0

    # the closing table, plain text (MMM_RICH=0), and report.md
    assert "fsdp_tp summary" in res.stdout
    for label in ("dt (step)", "tokens/s", "MFU", "model state (max rank)", "startup", "across ranks"):
        assert f"  {label}  " in res.stdout, label
    report = (tmp_path / "report.md").read_text()
    assert "python -m mmm.examples.fsdp_tp --dim 64" in report and "--wandb-name tiny" in report
    assert "pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=1" in report and "| tokens/s |" in report
    assert "| torch |" in report and "No plots (`--no-plots`)" in report


def test_a_crash_still_closes_the_trackers_with_every_finished_step(tmp_path):
    """A NaN at step 3 stops the run (exit 1): the trackers have steps 1-3, as history.jsonl does,
    and the W&B run is closed as failed. ``WANDB_DIR`` (scratch on a cluster) is honoured. Resumed from
    step 2's checkpoint, the run goes on in the same W&B run without sending step 3 again; a rollback to
    step 2 after that begins a new W&B run."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    scratch = clean_env(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "scratch"))
    flags = ["--max-iters", "6", "--wandb", "--tensorboard", "--no-plots", "--checkpoint-dir", str(tmp_path / "ck")]
    res = trainer(2, tmp_path, *flags, "--checkpoint-every", "2", env={**scratch, "MMM_FAULT": "nan@3"})
    assert res.returncode == 65 and "loss is nan at iter 3" in res.stderr, res.output  # 65: diverged
    assert "prterun detected" not in res.stderr  # Open MPI's box would only repeat each rank's one line
    hist = jsonl(tmp_path / "history.jsonl", key=None)
    assert [r["iter"] for r in hist] == [1, 2, 3] and math.isnan(hist[-1]["loss"])
    assert not (tmp_path / "wandb").exists()  # the run went to WANDB_DIR
    assert not (tmp_path / "stacks").exists()  # no stack was written: no empty rank-*.txt left behind
    records = wandb_records(the_run_dir(tmp_path / "scratch"))
    logged = wandb_history(records)
    assert sorted(logged) == [1, 2, 3] and logged[2]["loss"] == hist[1]["loss"] and math.isnan(logged[3]["loss"])
    assert wandb_exit_code(records) == 1
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert sorted(scalars["loss"]) == [1, 2, 3]
    assert scalars["dt"][2] == pytest.approx(hist[1]["dt"], rel=1e-6)

    def runs():  # (run id, steps logged) of each W&B run directory, oldest first
        dirs = sorted((tmp_path / "scratch" / "wandb").glob("offline-run-*"), key=lambda d: d.stat().st_mtime)
        return [(r.run_id, sorted(wandb_history(recs))) for d in dirs for recs in [wandb_records(d)] for r in
                [next(x.run for x in recs if x.WhichOneof("record_type") == "run")]]  # fmt: skip

    again = trainer(2, tmp_path, *flags, "--resume", "latest", env=scratch)
    assert again.returncode == 0 and "continued from step 3 (step 3, which it holds, not sent again)" in again.output, (
        again.output
    )
    (first, second) = runs()
    assert second == (first[0], [4, 5, 6]), runs()
    back = trainer(2, tmp_path, *flags, "--resume", "2", env=scratch)
    assert back.returncode == 0 and f"(run {first[0]} keeps the steps of the line this run left)" in back.output, (
        back.output
    )
    third = runs()[2]
    assert third[0] != first[0] and third[1] == [3, 4, 5, 6], runs()


def test_missing_extra_stops_every_rank_before_training(tmp_path):
    """``import wandb`` / ``import tensorboard`` fail (a shim on PYTHONPATH): each of 2 ranks, started
    by hand, exits 2; rank 0 prints one line naming both extras; nothing was trained."""
    from mmm.dist import free_port

    shim = tmp_path / "shim"
    shim.mkdir()
    for name in ("wandb", "tensorboard"):
        (shim / f"{name}.py").write_text(f'raise ImportError("No module named {name!r} (test shim)")\n')
    env = clean_env(
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=str(shim),
    )
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "mmm.examples.fsdp_tp",
        *TINY,
        "--max-iters",
        "2",
        "--wandb",
        "--tensorboard",
        "--outdir",
        str(out),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs
    errors = [line for line in outs[0][1].splitlines() if "error:" in line]
    assert len(errors) == 1, outs
    assert "--wandb needs the wandb package: pip install 'mmm[wandb]'" in errors[0]
    assert "--tensorboard needs the tensorboard package: pip install 'mmm[tensorboard]'" in errors[0]
    assert all("error:" not in err for _, err in outs[1:]), outs
    assert all("Traceback" not in o + e for o, e in outs), outs
    assert not (out / "history.jsonl").exists()


def test_rank_timings_name_the_slow_rank(tmp_path):
    """Rank 1 sleeps 0.3 s at the end of every step: every gathered step (each --log-every 2 and the
    last) names rank 1 as the slowest, about 0.3 s behind rank 0."""
    res = trainer(
        2,
        tmp_path,
        "--max-iters",
        "6",
        "--log-every",
        "2",
        "--rank-timings",
        "--no-plots",
        script=str(SCRIPTS / "slow_rank.py"),
        env=clean_env(SLOW_RANK="1", SLOW_SECONDS="0.3"),
    )
    assert res.returncode == 0, res.output
    hist = jsonl(tmp_path / "history.jsonl", key=None)
    gathered = [r for r in hist if "slowest_rank" in r]
    assert [r["iter"] for r in gathered] == [2, 4, 6]  # only logging steps: no collective on the others
    assert [r["slowest_rank"] for r in gathered] == [1, 1, 1], gathered
    assert all(0.2 < r["dt_lag"] < 0.9 for r in gathered), gathered
    # the ranks wait for rank 1's sleep (a step takes a few tens of ms without it); the fast rank may
    # finish its own end of step a little after rank 1 starts sleeping, so it waits less than 0.3 s
    # (0.244 s seen under a loaded CI run; 0.09 s once, when the loaded fast rank came to the step's
    # collective after most of the sleep): the mean over the ranks is held, not the fastest rank's
    assert all(r["dt_max"] >= r["dt_mean"] >= r["dt_min"] > 0 and r["dt_mean"] > 0.15 for r in gathered), gathered
    assert "slowest rank 1 (3 of 3 logged steps)" in res.stdout
    assert "slowest_rank=1" in res.stdout  # in the step lines too


def test_cnn_reports_test_accuracy_in_percent_and_a_rich_table(tmp_path):
    """One process, MMM_RICH=1: test_acc in percent in the log, epochs.jsonl and summary.json (a whole
    number of test images), and the closing summary as a rich table."""
    from mmm.data.images import load_digits_data

    res = run(
        [
            sys.executable,
            "-m",
            "mmm.examples.fsdp",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "4",
            "--outdir",
            str(tmp_path),
        ],
        env=clean_env(MMM_RICH="1", COLUMNS="160"),
        timeout=120,
    )
    assert res.returncode == 0, res.output
    (epoch,) = jsonl(tmp_path / "epochs.jsonl", key=None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    acc = summary["test_acc"]
    assert acc == epoch["test_acc"] and 1 < acc <= 100, acc
    n_test = len(load_digits_data(None).test.labels)
    assert acc * n_test / 100 == pytest.approx(round(acc * n_test / 100), abs=1e-6)  # correct images / n, in %
    assert f"test_acc={acc:.2f}" in res.stdout
    table = res.stdout[res.stdout.index("fsdp summary") :]
    assert "┃ metric" in table and "│ test accuracy" in table and f"{acc:.2f}%" in table, table
    assert "samples/s" in table and "│ startup" in table
    report = (tmp_path / "report.md").read_text()
    assert "python -m mmm.examples.fsdp --epochs 1" in report and f"| test accuracy | {acc:.2f}% |" in report
    for link in [line.split("(", 1)[1].rstrip(")") for line in report.splitlines() if line.startswith("![")]:
        assert (tmp_path / link).is_file(), link  # every plot linked is there
    assert "![loss](plots/loss.png)" in report


# --------------------------------------------------------------------------- in process
def test_import_mmm_and_training_do_not_import_trackers():
    code = (
        "import sys, mmm, mmm.training, mmm.history, mmm.tracking, mmm.cli, mmm.examples.fsdp_tp\n"
        "print([m for m in ('wandb', 'tensorboard') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("example", ["fsdp_tp", "fsdp", "vit"])
def test_every_trainer_has_the_tracking_flags(example):
    import importlib

    text = importlib.import_module(f"mmm.examples.{example}").build_parser().format_help()
    for flag in ("--wandb", "--wandb-project", "--wandb-name", "--tensorboard", "--rank-timings"):
        assert flag in text, (example, flag)


def test_wandb_flags_without_wandb_are_refused():
    from mmm.models.llama.recipe import command_line

    problems = command_line().parse(["--wandb-project", "p"]).run.problems()
    assert problems == ["--wandb-project only applies with --wandb; add --wandb or drop it"]


def test_a_failing_tracker_is_dropped_and_the_others_go_on(caplog):
    import logging

    from mmm.history import History
    from mmm.tracking import Trackers

    class Good:
        name = "good"

        def __init__(self):
            self.rows, self.closed = [], None

        def log(self, values, step):
            self.rows.append((step, dict(values)))

        def close(self, summary=None, *, failed=False):
            self.closed = (summary, failed)

    class Bad(Good):
        name = "bad"

        def log(self, values, step):
            raise RuntimeError("network down")

    good, bad = Good(), Bad()
    log = logging.getLogger("test_tracking")
    trackers = Trackers([bad, good], log=log)
    hist = History(None, hooks=[trackers.log_row])
    with caplog.at_level("WARNING"):
        hist.update(1, loss=2.0, dtf=None)
        hist.update({"loss": 1.5}, step=2)
    assert good.rows == [(1, {"loss": 2.0}), (2, {"loss": 1.5})]  # None left out, the step key apart
    assert trackers.trackers == [good] and bad.closed == (None, True)  # dropped, closed as failed
    assert "--bad failed, going on without it (history.jsonl has every step): RuntimeError: network down" in caplog.text
    trackers.close({"final_loss": 1.5})
    trackers.close(failed=True)  # idempotent: the first close stands
    assert good.closed == ({"final_loss": 1.5}, False)


def test_gather_rank_timings_without_a_process_group():
    from mmm.tracking import gather_rank_timings

    assert gather_rank_timings(0.25) == {
        "dt_min": 0.25,
        "dt_max": 0.25,
        "dt_mean": 0.25,
        "slowest_rank": 0,
        "dt_lag": 0.0,
    }


def test_summary_table_plain_and_rich():
    from mmm.tracking import summary_rows, summary_table

    summary = {
        "steps": 10,
        "warmup_excluded": 2,
        "final_loss": 1.25,
        "mfu": 0.125,
        "flops": {"peak_flops_per_rank": [1e12], "peak_source": "calibrated"},
        "stats": {"dt": {"mean": 0.5, "std": 0.1}, "tps": {"mean": 12345.6, "std": 1.0}},
        "memory_per_rank": [
            {"total_bytes": 2**20, "peak_rss_bytes": 3 * 2**20},
            {"total_bytes": 2 * 2**20, "peak_rss_bytes": 2**20},
        ],
        "startup_s": 3.5,
    }
    rows = dict(summary_rows(summary, rate_key="tps"))
    assert rows["final loss"] == "1.2500" and rows["dt (step)"] == "0.5000 s ± 0.1000"
    assert rows["tokens/s"] == "12,346" and rows["MFU"] == "12.50% of calibrated peak 1 TFLOP/s per rank"
    assert rows["model state (max rank)"].startswith("2.0 MiB") and rows["peak host memory (max rank)"] == "3.0 MiB"
    plain = summary_table(list(rows.items()), title="t", rich=False)
    assert plain.splitlines()[0] == "t" and re.search(r"^  tokens/s +12,346$", plain, re.M), plain
    from rich.console import Console
    from rich.table import Table

    table = summary_table(list(rows.items()), title="t", rich=True)
    assert isinstance(table, Table)
    console = Console(width=100, record=True, file=open("/dev/null", "w"))
    console.print(table)
    assert "│ tokens/s" in console.export_text()


def test_a_resumed_run_leaves_tensorboard_one_value_per_step(tmp_path):
    """Killed after step 7, resumed from step 5's checkpoint: steps 6 and 7 run again and TensorBoard
    (its own reader) keeps their new values only, not both."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmm.tracking import TensorBoardTracker

    first = TensorBoardTracker(tmp_path, config={})
    for step in range(1, 8):
        first.log({"loss": float(step)}, step)
    first.close()
    time.sleep(1.1)  # another event file (they are named by the second)
    again = TensorBoardTracker(tmp_path, config={}, resume_step=5)
    for step in range(6, 9):
        again.log({"loss": 10.0 * step}, step)
    again.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert got == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 60.0), (7, 70.0), (8, 80.0)], got
