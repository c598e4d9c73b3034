"""The whole story a researcher runs: token files prepared from text, warmup + cosine, evaluation every
N steps, W&B (offline) and TensorBoard, a preemption and a resume mid-run, a Hugging Face checkpoint
out that transformers loads with equal logits; against the same run left uninterrupted."""

from __future__ import annotations

import json
import math
import sys

import pytest

from conftest import SCRIPTS, clean_env, launch, run
from test_data import train_tokenizer
from test_tracking import tensorboard_scalars, wandb_history, wandb_records

FLAGS = [
    "-m",
    "mmm.examples.fsdp_tp",
    "--dim",
    "64",
    "--n-layers",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--seed",
    "3",
    "--no-plots",
    "--dataset",
    "bin",
    "--lr-schedule",
    "cosine",
    "--warmup-steps",
    "2",
    "--eval-every",
    "3",
    "--eval-iters",
    "2",
    "--max-iters",
    "6",
]


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bin_data_schedule_eval_trackers_resume_and_export(tmp_path):
    pytest.importorskip("tokenizers", reason="the data extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    from mmm.data import pydoc_text

    text = pydoc_text().decode("utf-8")
    docs = [text[i::4] for i in range(4)]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(doc)
    train_tokenizer(docs, tmp_path / "tokenizer.json")
    data = tmp_path / "data"
    res = run(
        [
            sys.executable,
            "-m",
            "mmm.data",
            "prepare",
            "--tokenizer",
            str(tmp_path / "tokenizer.json"),
            "--out",
            str(data),
            *(str(tmp_path / f"doc{i}.txt") for i in range(4)),
        ],
        timeout=120,
    )
    assert res.returncode == 0, res.output
    common = [*FLAGS, "--data-dir", str(data)]
    env = clean_env(WANDB_MODE="offline")

    ref = tmp_path / "ref"
    res = run(launch("-n", "2", "python3", *common, "--outdir", str(ref)), env=env, timeout=180)
    assert res.returncode == 0, res.output

    out, ck, hf = tmp_path / "out", tmp_path / "ck", tmp_path / "hf"
    tracked = [
        *common,
        "--checkpoint-dir",
        str(ck),
        "--wandb",
        "--tensorboard",
        "--export-hf",
        str(hf),
        "--outdir",
        str(out),
    ]
    res = run(
        launch("-n", "2", "python3", *tracked), env=clean_env(WANDB_MODE="offline", MMM_FAULT="term@3"), timeout=180
    )  # preempted at step 3 (a logging step: the flag is read at once): saves step 3
    assert res.returncode == 0, res.output
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "SIGTERM"
    assert [r["iter"] for r in rows(out / "history.jsonl")] == [1, 2, 3]
    assert not hf.exists()  # no export from a preempted run
    res = run(launch("-n", "2", "python3", *tracked, "--resume"), env=env, timeout=180)
    assert res.returncode == 0 and "step-00000003" in res.output, res.output

    got, want = rows(out / "history.jsonl"), rows(ref / "history.jsonl")
    assert [r["iter"] for r in got] == list(range(1, 7))  # one row per step across both runs
    for key in ("loss", "grad_norm", "lr"):
        for a, b in zip(got, want):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    assert [r["iter"] for r in got if "val_loss" in r] == [3, 6]
    for a, b in zip(got, want):
        if "val_loss" in b:
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"]
            assert a["val_ppl"] == pytest.approx(math.exp(a["val_loss"]), rel=1e-9)
    assert got[0]["lr"] < got[1]["lr"] > got[5]["lr"]  # warmup, then decay

    # the trackers hold what History holds: TensorBoard both runs' steps, each W&B run its own
    scalars = tensorboard_scalars(out / "tensorboard")
    assert {s: scalars["loss"][s] for s in range(1, 7)} == pytest.approx({r["iter"]: r["loss"] for r in got}, rel=1e-6)
    assert scalars["val_loss"] == pytest.approx({3: got[2]["val_loss"], 6: got[5]["val_loss"]}, rel=1e-6)
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    steps = [sorted(wandb_history(wandb_records(d))) for d in runs]
    assert steps == [[1, 2, 3], [4, 5, 6]], steps

    # the export: transformers reads it and gives mmm's logits
    res = run(
        [
            sys.executable,
            str(SCRIPTS / "hf_export_check.py"),
            str(hf),
            "--seq-len",
            "32",
            "--batch-size",
            "4",
            "--seed",
            "3",
            "--steps",
            "0",
        ],
        timeout=180,
    )
    assert res.returncode == 0, res.output
    check = json.loads(res.stdout.strip().splitlines()[-1])[str(hf)]
    assert check["max_abs_diff"] <= 1e-5 * max(1.0, check["logits_std"]), check
