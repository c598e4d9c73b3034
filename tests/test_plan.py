"""The planner (python -m mmm.plan): layouts, reasons, and estimates checked against measured runs."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import (
    SCRIPTS,
    assert_clean_user_error,
    calibrated_env,
    clean_env,
    descendants,
    launch,
    run,
    run_ranks,
    spawn,
    tiny_llama,
)
from mmm.errors import UsageError
from mmm.plan import plan, trainer_config
from mmm.plan.cli import main as plan_main
from mmm.plan.simulate import main as simulate_main


def _benchmark_main(name: str, argv: list[str]) -> int:
    """A benchmark's main, loaded from its file when called (benchmarks/ is not a package)."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def sweep_main(argv: list[str]) -> int:
    return _benchmark_main("sweep", argv)


def vs_ezpz_main(argv: list[str]) -> int:
    return _benchmark_main("vs_ezpz", argv)


FSDP_TP = ["-m", "mmm.examples.fsdp_tp", "--max-iters", "2", "--measure", "--no-plots"]

# Tolerances, as stated in the README: parameter/gradient/optimizer state within 2% (only the
# replicated norm weights and FSDP padding differ), communication per process group within 3%,
# activations within 10% (small fp32 side tensors: rsqrt, log-sum-exp, causal masks).
STATE_TOL, COMM_TOL, ACT_TOL = 0.02, 0.03, 0.10


def test_every_layout_listed_with_reasons():
    combos = plan(4)
    labels = [c.label for c in combos]
    assert len(labels) == len(set(labels))
    # 5 axes over 4 ranks: 15 factorizations x 6 strategies
    assert len(combos) == 15 * 6
    valid = {c.label for c in combos if c.valid}
    assert {
        "pp1-dpr1-dps4-cp1-tp1-ddp",
        "pp1-dpr1-dps2-cp1-tp2-fsdp",
        "pp1-dpr2-dps2-cp1-tp1-hsdp",
        "pp2-dpr1-dps2-cp1-tp1-fsdp",
        "pp1-dpr1-dps4-cp1-tp1-zero3",
    } <= valid
    by_label = {c.label: c for c in combos}
    assert any("DDP cannot hold sharded" in p for p in by_label["pp1-dpr1-dps2-cp1-tp2-ddp"].problems)
    assert any("needs --strategy hsdp" in p for p in by_label["pp1-dpr2-dps2-cp1-tp1-fsdp"].problems)
    for c in combos:
        assert c.valid == (c.memory is not None), c.label
        assert c.valid or c.problems


def test_degrees_given_as_overrides_are_held_never_ignored():
    """plan(4, tp=2) holds tp as --tp 2 does on the command line (it used to list every tp); so do ep and
    strategy; what plan could not honour is refused."""
    assert {c.label for c in plan(4, tp=2)} == {c.label for c in plan(4, fixed={"tp": 2})}
    assert {c.label.split("-")[4] for c in plan(4, tp=2)} == {"tp2"}
    assert {c.strategy for c in plan(4, strategy="fsdp")} == {"fsdp"}
    moe = plan(4, moe_experts=8, ep=2)
    assert moe and all("-ep2-" in c.label for c in moe)
    with pytest.raises(TypeError, match="tp=2 and fixed"):
        plan(4, tp=2, fixed={"tp": 4})
    with pytest.raises(TypeError, match="n_layers would be ignored"):
        plan(4, trainer_config(), n_layers=2)


def test_model_flags_change_validity_and_estimates():
    # 6 heads cannot be split over tp=4; a longer sequence costs more activation memory
    combos = {c.label: c for c in plan(4, n_heads=6, dim=192)}
    assert any("n-heads" in p or "heads" in p for p in combos["pp1-dpr1-dps1-cp1-tp4-fsdp"].problems)
    short = {c.label: c for c in plan(2, seq_len=64)}["pp1-dpr1-dps2-cp1-tp1-fsdp"]
    long = {c.label: c for c in plan(2, seq_len=128)}["pp1-dpr1-dps2-cp1-tp1-fsdp"]
    assert long.memory["activation_bytes"] > 1.9 * short.memory["activation_bytes"]


@pytest.mark.parametrize(
    "label, microbatches",
    [
        ("pp1-dpr1-dps2-cp1-tp2-fsdp", None),
        ("pp1-dpr1-dps1-cp2-tp2-fsdp", None),
        ("pp1-dpr2-dps2-cp1-tp1-hsdp", 2),  # gradient accumulation: gathers per microbatch, one all-reduce
        ("pp2-dpr1-dps2-cp1-tp1-fsdp", None),
    ],
)
def test_estimates_match_measured(tmp_path, label, microbatches):
    """The planner's estimates against the measured run, and the simulated ranks (python -m
    mmm.plan.simulate: the real composition on a fake process group) against the real ranks, exactly."""
    combo = {c.label: c for c in plan(4, max_iters=2, measure=True, microbatches=microbatches)}[label]
    flags = [*combo.flags, *(["--microbatches", str(microbatches)] if microbatches else [])]
    run_ranks(4, [*FSDP_TP, *flags], tmp_path, env=calibrated_env())  # the MFU's peak measured here
    s = json.loads((tmp_path / "summary.json").read_text())
    sim_json = tmp_path / "simulated.json"
    simulate = [sys.executable, "-m", "mmm.plan.simulate", "--world", "4", "--ranks", "0,1,2,3"]
    sim = run([*simulate, "--json", str(sim_json), *FSDP_TP[2:], *flags], timeout=180)
    assert sim.returncode == 0, sim.output
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes")
    real = [{k: m[k] for k in keys} for m in s["memory_per_rank"]]
    assert [{k: r[k] for k in keys} for r in json.loads(sim_json.read_text())] == real
    measured = s["measured_per_rank"]
    for real_rank, simulated in zip(measured, json.loads(sim_json.read_text()), strict=True):
        step = simulated["step"]  # the simulated step communicates what the real one did, call for call
        assert (step["comm_bytes"], step["comm_calls"]) == (real_rank["comm_bytes"], real_rank["comm_calls"])
        assert abs(step["activation_bytes"] / real_rank["activation_bytes"] - 1) < 0.02, (step, real_rank)
        assert (
            step["peak"]["total"] > step["peak"]["before_step"] >= simulated["param_bytes"] + simulated["optim_bytes"]
        )
        if combo.degrees["pp"] == 1:  # under pp the saved bytes are summed over microbatches, not all alive at once
            held = real_rank["activation_bytes"] / (microbatches or 1)  # under accumulation one microbatch's
            assert step["peak"]["total"] >= held + simulated["total_bytes"] * 0.75, step
    assert 0 < s["mfu"] < 1 and s["flops"]["peak_source"] == "calibrated", s["flops"]
    state = max(m["total_bytes"] for m in s["memory_per_rank"])
    assert abs(state / combo.memory["state_bytes"] - 1) <= STATE_TOL, (state, combo.memory)
    comm: dict[str, int] = {}
    for m in measured:
        for group, nbytes in m["comm_bytes"].items():
            comm[group] = max(comm.get(group, 0), nbytes)
    big = {g: b for g, b in comm.items() if b > 0.01 * max(comm.values())}  # loss all-reduces are bytes
    assert set(big) == set(combo.comm), (comm, combo.comm)
    for group, estimate in combo.comm.items():
        assert abs(comm[group] / estimate - 1) <= COMM_TOL, (group, comm, combo.comm)
    if combo.degrees["pp"] == 1:  # under PP the measure sums every microbatch, the estimate is the peak
        act = max(m["activation_bytes"] for m in measured) / (microbatches or 1)  # accumulation: one microbatch's
        assert abs(act / combo.memory["activation_bytes"] - 1) <= ACT_TOL, (act, combo.memory)


def test_cli_lists_table_invalid_reasons_and_json(tmp_path):
    out = tmp_path / "plan.json"
    res = run([sys.executable, "-m", "mmm.plan", "--world", "4", "--tp", "2", "--lr", "0.1", "--json", str(out)])
    assert res.returncode == 0, res.output
    assert "note: --lr shapes the run, not a layout's memory or communication: not planned" in res.stderr  # not dropped
    assert "valid layouts" in res.stdout and "comm:tp" in res.stdout
    assert "invalid layouts" in res.stdout and "DDP cannot hold sharded" in res.stdout
    rows = json.loads(out.read_text())
    assert rows and all(r["tp"] == 2 for r in rows)
    assert any(r["valid"] and r["memory"]["total_bytes"] > 0 for r in rows)


def _refusal(main, argv: list[str]) -> str:
    """The one line a command's main refuses argv with, in this process: its UsageError, or argparse's error."""
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises((UsageError, SystemExit)) as e:
        main(argv)
    if isinstance(e.value, SystemExit):
        assert e.value.code == 2, err.getvalue()
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        assert len(lines) == 1, err.getvalue()
        return lines[0]
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "command, flags, needles",
    [
        ("plan", ["--world", "0"], ["--world", "0"]),
        ("plan", ["--world", "4", "--tp", "3"], ["tp=3"]),
        ("plan", ["--world", "4", "--tp", "2", "--strategy", "ddp"], ["ddp", "tp=2"]),
        ("plan", ["--world", "4", "--strategies", "fsdp,zero9"], ["zero9"]),
        ("plan", ["--world", "4", "--json", "/"], ["--json '/' is a directory; give a file name"]),  # before any work
        ("plan", ["--world", "4", "--moe-experts", "4", "--ep", "3"], ["--ep 3 does not divide the 4 experts"]),
        ("plan", ["--world", "4", "--ep", "2"], ["--ep 2 splits a mixture of experts' experts; add --moe-experts"]),
        ("simulate", ["--world", "64", "--strategy", "zero2"], ["--strategy zero2 is not simulated"]),
        ("simulate", ["--world", "64", "--strategy", "ddp"], ["--strategy ddp is not simulated", "fsdp or hsdp"]),
        ("simulate", ["--world", "8", "--ranks", "0,8"], ["--ranks '0,8'", "from 0 to 7"]),
        ("simulate", ["--world", "8", "--hardware", "tpu9"], ["--hardware 'tpu9'", "h100"]),
        ("simulate", ["--world", "8", "--hardware", "h100", "--no-step"], ["drop --no-step"]),
        ("simulate", ["--world", "8", "--moe-experts", "4", "--expert-load", "2", "--no-step"],
         ["--expert-load 2 routes"]),
        ("simulate", ["--world", "4", "--moe-experts", "4", "--moe-top-k", "4", "--expert-load", "3"],
         ["--expert-load 3 must be between 1 (balanced) and 1", "4 experts, each token to 4)"]),
        ("simulate", ["--world", "8", "--float8", "--dtype", "bf16"], ["--float8 is not simulated"]),
        ("simulate", ["--world", "8", "--pick-layout", "h100"], ["--pick-layout is the trainer's"]),
        ("simulate", ["--world", "8", "--hard", "h100"], ["unrecognized arguments: --hard h100"]),  # no abbreviations
        ("simulate", ["--world", "8", "--json", "/"], ["--json '/' is a directory; give a file name"]),
    ],
)  # fmt: skip
def test_planner_and_simulator_refuse_in_one_line(command, flags, needles, tmp_path, monkeypatch):
    """In this process, through each command's main (the commands' own exit and one line: the next test)."""
    monkeypatch.chdir(tmp_path)
    main = {"plan": plan_main, "simulate": simulate_main}[command]
    line = _refusal(main, flags)
    assert all(n in line for n in needles), (flags, line)
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written


def test_no_valid_layout_says_the_runs_own_problem_or_the_nearest_layouts(tmp_path, monkeypatch):
    """A problem of every layout (the run's own: --init-from a folder without config.json) is said alone, not
    once per layout with each layout's others; where each layout has its own, the nearest ones are said."""
    monkeypatch.chdir(tmp_path)
    line = _refusal(plan_main, ["--world", "2", "--init-from", "."])
    assert line == "no valid layout of 2 ranks: no config.json in .: a Hugging Face checkpoint directory has one"
    line = _refusal(plan_main, ["--world", "3", "--dim", "64", "--n-heads", "8"])
    assert line.startswith("no valid layout of 3 ranks: 30 layouts tried, the nearest: ") and len(line) < 400, line
    assert "--batch-size 16 is not divisible by 3 data-parallel ranks" in line, line


def test_a_recipes_run_only_flags_are_noted_not_dropped(capsys):
    """Flags that shape the run and not a step (the CNN's --epochs and --save-model, any trainer's schedule)
    are said in a note, for every recipe: the planner takes a trainer's command line as it is."""
    assert plan_main(["--recipe", "cnn", "--world", "2", "--epochs", "3", "--save-model", "--lr", "0.1"]) == 0
    err = capsys.readouterr().err
    assert "note: --lr, --epochs, --save-model shape the run, not a layout's memory" in err, err


def test_a_mixture_of_experts_plan_shows_each_layouts_ep(capsys):
    """One row per ep degree: without the column, the rows of ep 1 and 2 of a layout read the same. The closed
    form does not estimate experts: the table has no memory columns (they were all dashes)."""
    assert plan_main(["--world", "4", "--moe-experts", "4", "--dim", "32", "--n-heads", "4", "--n-layers", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(ln.split() for ln in lines if ln.lstrip().startswith("#"))
    assert head == ["#", "pp", "dpr", "dps", "cp", "tp", "ep", "strategy"], head
    assert "valid layouts (no estimates)" in lines[0], lines[0]
    rows = [ln.split()[1:8] for ln in lines[3:] if ln.strip()[:1].isdigit()]  # the degrees and the strategy
    assert len(rows) == len({tuple(r) for r in rows}) and any(r[5] == "2" for r in rows), rows


def test_a_flag_that_narrows_the_layouts_is_said(capsys):
    """--cp-attention ulysses makes every layout without context parallel invalid (the trainer would refuse the
    flag there): said in a note, not left to be noticed."""
    assert plan_main(["--world", "4", "--cp-attention", "ulysses", "--dim", "32", "--n-heads", "4"]) == 0
    err = capsys.readouterr().err
    assert "note: --cp-attention ulysses applies with --cp > 1: the layouts without context parallel" in err, err


@pytest.mark.parametrize(
    "module, flags, needles",
    [
        ("mmm.plan", ["--world", "4", "--tp", "3"], ["tp=3"]),
        ("mmm.plan.simulate", ["--world", "8", "--compile"], ["--compile is not simulated"]),
        # a layout that cannot start at 1,024 ranks fails in the simulation with the trainer's own line
        ("mmm.plan.simulate", ["--world", "1024", "--tp", "16", "--n-heads", "8"],
         ["--n-heads 8 is not divisible by tp=16"]),
    ],
)  # fmt: skip
def test_planner_and_simulator_exit_2_with_one_line(module, flags, needles):
    res = run([sys.executable, "-m", module, *flags], timeout=120)
    assert res.returncode == 2
    assert_clean_user_error(res, *needles)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_json_to_stdout_is_the_json_alone():
    """--json -: the planner's and the simulator's stdout parse as JSON (tables and the simulated ranks' log
    lines go to stderr)."""
    for module, key in (("mmm.plan", "label"), ("mmm.plan.simulate", "rank")):  # a layout each; a rank each
        res = run([sys.executable, "-m", module, "--world", "2", "--json", "-"], timeout=120)
        assert res.returncode == 0, res.output
        rows = json.loads(res.stdout)
        assert rows and all(key in r for r in rows), res.stdout[:500]


def test_flops_formula_matches_counted_flops():
    import torch

    from mmm.flops import counted_flops_per_sample, llama_flops_per_token
    from mmm.models.llama import Llama, LlamaConfig

    for cfg in (LlamaConfig(), LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=2, seq_len=256)):
        counted = counted_flops_per_sample(lambda: Llama(cfg), (cfg.seq_len,), torch.long) / cfg.seq_len
        assert abs(llama_flops_per_token(cfg) / counted - 1) < 0.02, (cfg, counted)


def test_peak_table_and_env(monkeypatch):
    import torch

    from mmm.flops import mfu, peak_flops, table_peak

    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert table_peak("Intel(R) Data Center GPU Max 1550", "bf16") == 419.4e12
    assert table_peak("Some Future GPU", "bf16") is None
    monkeypatch.setenv("MMM_PEAK_TFLOPS", "2.5")
    assert peak_flops(torch.device("cpu")) == (2.5e12, "env")
    assert mfu(tokens_per_s=1000, flops_per_token=1e9, peaks=[1e12, 1e12]) == 0.5
    assert mfu(tokens_per_s=1000, flops_per_token=1e9, peaks=[1e12, None]) is None


SWEEP = [
    sys.executable,
    "benchmarks/sweep.py",
    "--world",
    "2",
    "--max-iters",
    "4",
    "--dim",
    "64",
    "--n-layers",
    "2",
    "--seq-len",
    "32",
]


def test_sweep_runs_layouts_and_writes_table_dataset_plots(tmp_path):
    import xarray as xr

    combos = "pp1-dpr1-dps2-cp1-tp1-ddp,pp1-dpr1-dps1-cp1-tp2-fsdp"
    res = run([*SWEEP, "--combos", combos, "--out", str(tmp_path)], timeout=240)
    assert res.returncode == 0, res.output
    ds = xr.open_dataset(tmp_path / "results.nc")
    assert list(ds["combo"].values) == combos.split(",")
    assert ds["ok"].values.all()
    assert (ds["tokens_per_s"].values > 0).all() and (ds["startup_s"].values > 0).all()
    assert ((ds["mfu"].values > 0) & (ds["mfu"].values < 1)).all()
    # measured communication sits next to the planner's estimate
    tp = ds["comm_bytes"].sel(combo="pp1-dpr1-dps1-cp1-tp2-fsdp", group="tp").item()
    assert abs(tp / ds["est_comm_bytes"].sel(combo="pp1-dpr1-dps1-cp1-tp2-fsdp", group="tp").item() - 1) < COMM_TOL
    table = (tmp_path / "results.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 2 ")]
    assert len(rows) == 2 and rows[0].rstrip().endswith("| 1.00 |"), table
    for name in ("tokens_per_s", "step_split"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
        assert "pp1-dpr1-dps2-cp1-tp1-ddp" in (tmp_path / "plots" / f"{name}.txt").read_text()


def test_sweep_records_a_failed_layout_and_goes_on(tmp_path):
    import numpy as np
    import xarray as xr

    # one second is too short for any run: each is stopped (with its ranks), recorded, and the sweep goes on
    res = run(
        [
            *SWEEP,
            "--combos",
            "pp1-dpr1-dps2-cp1-tp1-ddp,pp1-dpr1-dps2-cp1-tp1-fsdp",
            "--timeout",
            "1",
            "--out",
            str(tmp_path),
        ],
        timeout=120,
    )
    assert res.returncode == 1, res.output
    assert res.output.count("FAILED") == 2, res.output
    ds = xr.open_dataset(tmp_path / "results.nc")
    assert not ds["ok"].values.any()
    assert all("timed out after 1s" in e for e in ds["error"].values)
    assert "failed: " in (tmp_path / "results.md").read_text()
    # a mixture of experts: the planner has no closed-form estimate for it, the dataset says NaN
    moe = run([*SWEEP, "--moe-experts", "4", "--combos", "pp1-dpr1-dps2-cp1-tp1-ep2-fsdp", "--timeout", "1",
               "--out", str(tmp_path / "moe")], timeout=60)  # fmt: skip
    assert moe.returncode == 1 and "Traceback" not in moe.output, moe.output
    assert np.isnan(xr.open_dataset(tmp_path / "moe" / "results.nc")["est_total_bytes"].values).all()
    # Ctrl-C (SIGINT to the sweep alone: each run has a session of its own) stops the running layout's ranks
    out = tmp_path / "int"
    with spawn([*SWEEP, "--max-iters", "100000", "--combos", "pp1-dpr1-dps2-cp1-tp1-ddp", "--out", str(out)],
               stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:  # fmt: skip
        history = out / "runs" / "pp1-dpr1-dps2-cp1-tp1-ddp" / "history.jsonl"
        deadline = time.monotonic() + 60
        while not (history.is_file() and history.read_text()) and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        started = descendants(p.pid)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "sweep: interrupted during pp1-dpr1-dps2-cp1-tp1-ddp (0 of 1" in err, err
    deadline = time.monotonic() + 10  # (a rank may take a moment to go)
    while [q for q in started if Path(f"/proc/{q}").exists()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started and not [q for q in started if Path(f"/proc/{q}").exists()], started  # no rank left running
    assert (history.parent / "INTERRUPTED").is_file() and not (out / "results.nc").exists()
    before = (tmp_path / "results.nc").read_bytes()  # a sweep into the same folder: refused, nothing replaced
    again = run([*SWEEP, "--combos", "pp1-dpr1-dps2-cp1-tp1-ddp", "--out", str(tmp_path)], timeout=60)
    assert_clean_user_error(again, f"--out {tmp_path} holds an earlier sweep (results.nc): give another --out")
    assert (tmp_path / "results.nc").read_bytes() == before


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--world", "0"], ["--world", "0"]),
        (["--world", "2", "--combos", "pp1-dpr1-dps1-cp1-tp2-ddp"], ["pp1-dpr1-dps1-cp1-tp2-ddp", "DDP"]),
        (["--world", "2", "--combos", "pp1-dpr1-dps3-cp1-tp1-ddp"], ["pp1-dpr1-dps3-cp1-tp1-ddp"]),
        (["--world", "2", "--tp", "3"], ["tp=3"]),
    ],
)
def test_sweep_bad_input(flags, needles, tmp_path):
    """In this process through the sweep's main; its own exit 2 and one line with the first row."""
    if flags == ["--world", "0"]:
        res = run([sys.executable, "benchmarks/sweep.py", *flags, "--out", str(tmp_path / "out")], timeout=60)
        assert res.returncode == 2
        assert_clean_user_error(res, *needles)
    else:
        line = _refusal(sweep_main, [*flags, "--out", str(tmp_path / "out")])
        assert all(n in line for n in needles), (flags, line)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--ranks", "4", "--tp", "3"], "--tp 3 does not divide --ranks 4"),
        (["--ranks", "4", "--tp", "2", "--batch-size", "5"], "--batch-size 5 is not divisible by dp=2"),
        (["--steps", "3"], "--steps 3: give more than 3"),
        (["--dim", "100", "--n-heads", "8"], "--dim 100 is not divisible by --n-heads 8"),
        (["--ezpz-python", "/nonexistent/python"], "--ezpz-python '/nonexistent/python' is not an executable file"),
        (["--ezpz-python", sys.executable], "has no ezpz.examples.fsdp_tp; install ezpz in an environment"),
        (["--out", "FILE"], "is a file; pass a directory"),
    ],
)
def test_the_ezpz_comparison_refuses_in_one_line(flags, needle, tmp_path):
    """benchmarks/vs_ezpz.py's checks, before any run (ezpz is not installed here: the comparison's numbers are in
    docs/benchmarks.md)."""
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    line = _refusal(vs_ezpz_main, argv if "--out" in argv else [*argv, "--out", str(tmp_path / "o")])
    assert needle in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing made


# --------------------------------------------------------------------------- hardware and predicted step time
def test_hardware_presets_and_a_file_of_your_own(tmp_path):
    from mmm.plan.hardware import PRESETS, load_hardware

    for name, hw in PRESETS.items():
        assert load_hardware(name.upper()) is hw and hw.source and hw.peak("bf16") > hw.peak("fp32") > 0
        assert hw.intra_node_bps > 0 and hw.inter_node_bps > 0 and hw.memory_bytes > 32e9 and hw.memory_bps > 1e12
    mine = tmp_path / "cluster.json"
    mine.write_text(
        json.dumps(
            {
                "name": "ours",
                "devices_per_node": 4,
                "memory_gb": 96,
                "peak_tflops": {"bf16": 500},
                "intra_node_gbps": 400,
                "inter_node_gbps": 25,
            }
        )
    )
    hw = load_hardware(str(mine))
    assert (hw.name, hw.devices_per_node, hw.peak("bf16"), hw.inter_node_bps) == ("ours", 4, 500e12, 25e9)
    assert hw.memory_bps == 0  # not given: memory-bound ops are not counted apart
    mine.write_text(json.dumps({**json.loads(mine.read_text()), "memory_bandwidth_gbps": 2000}))
    assert load_hardware(str(mine)).memory_bps == 2000e9
    with pytest.raises(UsageError, match="no peak FLOP/s for dtype fp32"):
        hw.peak("fp32")
    mine.write_text('{"devices_per_node": 4}')
    with pytest.raises(UsageError, match="missing field 'memory_gb'"):
        load_hardware(str(mine))
    with pytest.raises(UsageError, match="neither a preset"):
        load_hardware(str(tmp_path / "nope.json"))
    good = json.loads(json.dumps({"devices_per_node": 4, "memory_gb": 96, "peak_tflops": {"bf16": 500}}))
    good |= {"intra_node_gbps": 400, "inter_node_gbps": 25}
    for change, needle in [
        ({"devices_per_node": 0}, "devices_per_node 0 must be a positive number"),
        ({"inter_node_gbps": -1}, "inter_node_gbps -1 must be a positive number"),
        ({"matmul_eficiency": 0.5}, "unknown field 'matmul_eficiency'"),
        ({"matmul_efficiency": 60}, "at most 1"),
        ({"memory_efficiency": 1.5}, "memory_efficiency 1.5 is a fraction of peak, at most 1"),
        ({"memory_bandwidth_gbps": 0}, "memory_bandwidth_gbps 0 must be a positive number"),
        ({"peak_tflops": 500}, "peak_tflops is a map"),
    ]:
        mine.write_text(json.dumps({**good, **change}))
        with pytest.raises(UsageError, match=needle):
            load_hardware(str(mine))
    mine.write_text("[1, 2]")
    with pytest.raises(UsageError, match="give a JSON object"):
        load_hardware(str(mine))


def test_predicted_step_time_adds_up_and_follows_the_links():
    from mmm.plan.hardware import PRESETS
    from mmm.plan.predict import predict

    hw = PRESETS["h100"]
    gib = 2**30
    step = {
        "comm_by_kind": {("dp_shard", "all_gather"): 32 * gib, ("dp_shard", "reduce_scatter"): 32 * gib},
        "comm_calls": {"dp_shard": 100, "tp": 200},
        "peak": {"total": 40 * gib},
    }
    step["comm_by_kind"][("tp", "all_reduce")] = 8 * gib
    inside = {"dp_shard": {"size": 8, "crosses_nodes": False}, "tp": {"size": 8, "crosses_nodes": False}}
    across = {**inside, "dp_shard": {"size": 64, "crosses_nodes": True}}
    kw = dict(flops=1e15, dtype="bf16", n_layers=32)
    a, b = predict(step, inside, hw, **kw), predict(step, across, hw, **kw)
    for p in (a, b):
        assert abs(p.step_s - (p.compute_s + p.bubble_s + sum(p.exposed_s.values()))) < 1e-12
        assert p.exposed_s["tp"] == p.comm_s["tp"]  # TP is on the critical path
        assert p.exposed_s["dp_shard"] < p.comm_s["dp_shard"]  # FSDP overlaps with compute
        assert p.fits and 0 < p.mfu < hw.matmul_efficiency
    assert b.comm_s["dp_shard"] > 8 * a.comm_s["dp_shard"]  # 50 GB/s between nodes, 450 inside one
    assert abs(a.compute_s - 1e15 / (989.4e12 * hw.matmul_efficiency)) < 1e-9
    tp = 8 * gib * 2 * 7 / 8 / hw.intra_node_bps + 200 * hw.latency_s  # a ring all-reduce moves 2(n-1)/n
    assert abs(a.comm_s["tp"] - tp) < 1e-9
    too_big = predict({**step, "peak": {"total": 79 * gib}}, inside, hw, **kw)
    assert not too_big.fits  # 10% margin under 80 GB
    slower = predict(step, inside, hw, flops=1e15, recompute=4 / 3, dtype="bf16", n_layers=32)
    assert slower.compute_s > a.compute_s and slower.mfu < a.mfu
    # a pipeline's bubble: (pp - 1) / microbatches of the compute on devices of their own; where 4 ranks
    # share 2 cores, an idle rank's share goes to the others and a short bubble costs nothing
    piped = predict(step, inside, hw, **kw, pp=2, microbatches=2)
    assert abs(piped.bubble_s - a.compute_s / 2) < 1e-12
    shared = replace(hw, devices_per_node=4, cores_per_node=2)
    assert predict(step, inside, shared, **kw, pp=2, microbatches=2).bubble_s == 0
    long = predict(step, inside, shared, **kw, pp=4, microbatches=1)  # critical path 4x at 2x the rate
    assert abs(long.bubble_s - a.compute_s) < 1e-9
    # ranks that share cores have none free to move FSDP's data while they compute: nothing overlaps
    crowded = predict(step, inside, shared, **kw)
    assert crowded.exposed_s["dp_shard"] == crowded.comm_s["dp_shard"] > a.exposed_s["dp_shard"]
    roomy = predict(step, inside, replace(hw, devices_per_node=2, cores_per_node=2), **kw)
    assert roomy.exposed_s["dp_shard"] == a.exposed_s["dp_shard"]
    # the experts: their FSDP over efsdp overlaps as the blocks' does; their all-to-all is exposed whole, at
    # the (n-1)/n of its payload that leaves each rank
    moe = {**step, "comm_by_kind": {**step["comm_by_kind"], ("efsdp", "all_gather"): gib, ("ep", "all_to_all"): gib}}
    moe["comm_calls"] = {**step["comm_calls"], "efsdp": 10, "ep": 10}
    experts = {**inside, "efsdp": {"size": 2, "crosses_nodes": False}, "ep": {"size": 4, "crosses_nodes": False}}
    m = predict(moe, experts, hw, **kw)
    assert m.exposed_s["efsdp"] < m.comm_s["efsdp"] and m.exposed_s["ep"] == m.comm_s["ep"]
    assert abs(m.comm_s["ep"] - (gib * 3 / 4 / hw.intra_node_bps + 10 * hw.latency_s)) < 1e-12
    # memory-bound ops: their bytes at the device memory's pace, after the matmuls (eager kernels run in turn)
    moved = predict({**step, "memory_bytes": 100 * gib}, inside, hw, **kw)
    assert moved.memory_s == 100 * gib / (hw.memory_bps * hw.memory_efficiency) and moved.matmul_s == a.matmul_s
    assert moved.compute_s == moved.matmul_s + moved.memory_s and moved.step_s > a.step_s + moved.memory_s * 0.99
    calibrated = replace(hw, memory_bps=0.0)  # a calibrated file's efficiency measured the whole step
    assert predict({**step, "memory_bytes": 100 * gib}, inside, calibrated, **kw).memory_s == 0


def test_device_work_counts_matmul_flops_and_the_bytes_other_ops_move():
    """The simulated step's device work, op by op: a matrix multiply counts 2 m n k FLOPs; any other op
    that computes counts the bytes it reads and writes (an in-place op its tensor twice, a foreach op
    each tensor of its lists, a copy its source and its destination once); views and allocations nothing."""
    import torch

    from mmm.measure import DeviceWork

    x, a, b, bias = torch.randn(1000), torch.randn(8, 16), torch.randn(16, 4), torch.randn(4)
    with DeviceWork() as w:
        y = x * 2 + 1  # two ops, each reads 4,000 bytes and writes 4,000
        a @ b  # 2 x 8 x 16 x 4 FLOPs
        torch.addmm(bias, a, b)  # the same, and its bias is no traffic of a memory-bound op
        torch.bmm(a.view(2, 4, 16), b.expand(2, 16, 4))  # views: no bytes
        x.add_(1)  # reads x, writes x
        torch._foreach_mul_([x, y], 0.5)  # reads and writes both
        torch.empty(10**6)  # an allocation moves nothing
        y.copy_(x)  # reads x, writes y
        x.to(torch.bfloat16)  # reads 4,000 bytes, writes 2,000
    assert w.matmul_flops == 3 * 2 * 8 * 16 * 4
    moved = {"mul": 8000, "add": 8000, "add_": 8000, "_foreach_mul_": 16000, "copy_": 8000, "_to_copy": 6000}
    assert dict(w.bytes_by_op) == moved and w.memory_bytes == sum(moved.values())


def test_a_norm_counts_as_the_one_fused_kernel_a_gpu_runs():
    """``F.rms_norm``, which a CPU build splits into ~20 elementwise ops, counts as CUDA's fused kernels:
    forward reads the input and weight and writes the output and each row's rstd; backward reads the
    output's gradient, input, rstd and weight and writes both gradients; the input and rstd are what it
    keeps. Its values are the norm's (so a real step under the counter is the same step)."""
    import torch
    import torch.nn.functional as F

    from mmm.measure import DeviceWork, SavedActivations

    leaf = torch.randn(6, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    x = leaf * 1  # an activation (a leaf is not one)
    weight = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(6, 5, 64, dtype=torch.bfloat16)
    ref = F.rms_norm(x.float(), (64,), weight.float(), 1e-6)
    ref_grads = torch.autograd.grad(ref, (x, weight), grad.float(), retain_graph=True)
    rows, elems = 30, 30 * 64
    for fused in (True, False):
        with DeviceWork(fused_norms=fused) as work, SavedActivations() as saved:
            out = F.rms_norm(x, (64,), weight, 1e-6)
            grads = torch.autograd.grad(out, (x, weight), grad, retain_graph=True)
        ops = dict(work.bytes_by_op)
        if fused:
            assert ops == {
                "rms_norm": 2 * elems + 2 * 64 + 2 * elems + 4 * rows,
                "rms_norm_backward": 2 * elems + 2 * elems + 4 * rows + 2 * 64 + 2 * elems + 2 * 64,
            }, ops
            assert saved.bytes == 2 * elems + 4 * rows  # the input (bf16) and rstd (fp32)
        else:
            assert "rms_norm" not in ops and len(ops) > 5, ops  # this CPU build's own ops
        assert (out.float() - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()  # one bf16 rounding
        for got, exp in zip(grads, ref_grads):
            assert (got.float() - exp).abs().max() <= 2**-6 * exp.abs().max(), (got, exp)


def test_the_simulated_step_runs_the_kernels_the_trainer_runs_on_its_device():
    """On an accelerator's preset the simulated rank's norms are the fused kernels (less kept for backward
    than this CPU build's ops keep), and AdamW, built on meta where no fused kernel exists, steps fused as
    the trainer's does on a device (one ``_fused_adamw_``, none of the foreach form's passes). Under TP the
    sequence-parallel norms (DTensors) are fused too, with the same collectives as torch's own path."""
    code = """
import json, sys
import mmm.measure as measure
import mmm.plan.fake as sim
from mmm.models.llama.recipe import command_line
from mmm.plan.hardware import PRESETS
seen = set()
real = measure.DeviceWork.local_op
def local_op(self, func, *args):
    seen.add(func._schema.name.split("::")[-1] if hasattr(func, "_schema") else str(func))
    return real(self, func, *args)
measure.DeviceWork.local_op = local_op
out = {}
for world, flags in ((1, []), (2, ["--tp", "2"])):
    config = command_line().parse([*sys.argv[1:], *flags])
    for hw in ("h100", None):
        seen.clear()
        (report,) = sim.simulate_ranks(config, world=world, ranks=[0], hardware=PRESETS.get(hw))
        step = report.step
        out[f"{world}-{hw}"] = {"ops": sorted(seen), "saved": step["activation_bytes"], "moved": step["memory_bytes"],
                                "comm": [step["comm_bytes"], step["comm_calls"]]}
print(json.dumps(out))
"""
    res = run([sys.executable, "-c", code, *tiny_llama(), "--dtype", "bf16"], timeout=180)
    assert res.returncode == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for world in (1, 2):
        gpu, cpu = got[f"{world}-h100"], got[f"{world}-None"]
        assert "rms_norm" in gpu["ops"] and "rsqrt" not in gpu["ops"], gpu
        assert "rms_norm" not in cpu["ops"] and "rsqrt" in cpu["ops"], cpu
        foreach = {"lerp_", "addcdiv_", "_foreach_lerp_", "_foreach_addcdiv_"}
        for ops in (gpu["ops"], cpu["ops"]):
            assert "_fused_adamw_" in ops and not foreach & set(ops), ops
        assert gpu["saved"] < cpu["saved"] and gpu["moved"] < cpu["moved"], got
        assert gpu["comm"] == cpu["comm"], (world, gpu["comm"], cpu["comm"])  # the same collectives, byte for byte


def test_peak_memory_sees_a_storage_resized_to_nothing_and_back():
    """FSDP2 frees a gathered block by resizing its buffer's storage to nothing (and grows it again at
    the next all-gather): a storage method no dispatch mode sees. Counted as held, every block ever
    gathered stayed in the simulated peak (Llama-3.1-405B: 0.74 GiB a block, 93 GiB in all)."""
    import torch

    from mmm.measure import PeakMemory

    with PeakMemory(trace=True) as m:
        buffer = torch.empty(1000)  # 4,000 bytes
        buffer.untyped_storage().resize_(0)  # freed, its Python object alive
        other = torch.empty(1000)  # 4,000 bytes again: the peak is still 4,000
        buffer.untyped_storage().resize_(4000)  # gathered again: 8,000
        del other
        torch.empty(500)  # 2,000 on top of 4,000
    assert m.peak == 8000 and m.live == 4000, (m.peak, m.live)
    assert [alive for _, alive in m.trace] == [0, 4000, 0, 4000, 8000, 6000], m.trace
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # put back on leaving


def test_simulate_predicts_on_hardware(tmp_path):
    out = tmp_path / "sim.json"
    flags = ["--world", "16", "--tp", "2", "--max-iters", "2", "--hardware", "a100", "--devices-per-node", "4"]
    res = run([sys.executable, "-m", "mmm.plan.simulate", *flags, "--json", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    assert "predicted on a100" in res.stdout
    assert "note: --max-iters shapes the run, not its step: not simulated" in res.stderr  # said, not ignored
    for r in json.loads(out.read_text()):
        assert r["axes"]["tp"] == {"size": 2, "crosses_nodes": False}
        assert r["axes"]["dp_shard"] == {"size": 8, "crosses_nodes": True}  # 8 ranks, 2 apart, 4 per node
        p = r["prediction"]
        assert p["hardware"] == "a100" and p["fits"] is True and p["step_s"] > p["compute_s"] > 0
        assert r["step"]["memory_bytes"] > 0 and p["memory_s"] > 0 and p["compute_s"] == p["matmul_s"] + p["memory_s"]
        assert set(p["comm_s"]) == set(r["step"]["comm_bytes"])


def _hardware_file(path, memory_gb=1.0, inter_node_gbps=0.5):
    path.write_text(
        json.dumps(
            {
                "name": "two per node",
                "devices_per_node": 2,
                "memory_gb": memory_gb,
                "peak_tflops": {"fp32": 0.05},
                "intra_node_gbps": 2,
                "inter_node_gbps": inter_node_gbps,
                "latency_us": 50,
                "matmul_efficiency": 0.3,
            }
        )
    )
    return str(path)


def test_pick_ranks_the_layouts_and_holds_the_given_degrees(tmp_path):
    hw, out = _hardware_file(tmp_path / "hw.json"), tmp_path / "ranked.json"
    pick = [sys.executable, "-m", "mmm.plan.simulate", "--world", "4", "--max-iters", "2", "--pick"]
    res = run([*pick, "--hardware", hw, "--tp", "2", "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.output
    said = re.search(  # the others cannot win: their floor is no faster than the best
        r"(\d+) of \1 layouts with a pipeline or context parallel not simulated: their floor \(.*; the closest, "
        r"(pp\S+): ([0-9.]+) ms\) exceeds the best step without either \(([0-9.]+) ms\)",
        res.output,
    )
    # cp 2, and pp 2 (with 2, 4 and 8 microbatches: 1, 2 and 4 per stage, none simulated)
    assert said and said.group(1) == "2", res.output
    assert "0 of 2 pipeline layouts with more microbatches per stage simulated" in res.output
    (four,) = json.loads(out.read_text())
    assert float(said.group(3)) >= float(said.group(4)) == round(four["step_s"] * 1e3, 1), res.output
    assert four["ac"] is None and "--ac" not in four["flags"], four  # no AC needed to fit: none added
    assert f"pick: {' '.join(four['flags'])}" in res.stdout and "ranked by predicted step time" in res.stdout
    assert "compute" in four["why"] and "tp " in four["why"], four  # the reason: what the step waits for
    # a pipeline whose floor loses may win with more microbatches: the variants whose own floor is under
    # the best are simulated (a slow network: FSDP's traffic across nodes costs more than 8 microbatches'
    # bubble, not more than 2's)
    slow = _hardware_file(tmp_path / "slow.json", inter_node_gbps=0.02)
    res = run([*pick, "--hardware", slow, "--tp", "2", "--json", str(out)], timeout=300)
    assert res.returncode == 0 and "1 of 2 pipeline layouts with more microbatches per stage simulated" in res.output
    labels = [r["label"] for r in json.loads(out.read_text())]
    assert "pp2-dpr1-dps1-cp1-tp2-fsdp-mb8" in labels and "pp2-dpr1-dps1-cp1-tp2-fsdp" not in labels, labels
    # at most REVIVED_AT_MOST of them, the lowest floors first (at 70B's size nearly every variant's floor
    # is under the best): with none allowed, the variant is left out and the log says so
    code = "import mmm.plan.ranking as r, mmm.plan.simulate as s; r.REVIVED_AT_MOST = 0; s.cli()"
    capped = [sys.executable, "-c", code, *pick[3:]]
    res = run([*capped, "--hardware", slow, "--tp", "2", "--json", str(out)], timeout=300)
    assert res.returncode == 0 and "0 of 2 pipeline layouts with more microbatches per stage simulated" in res.output
    assert "1 variants with more microbatches of pipelines left out by their floor" in res.output, res.output
    assert "pp2-dpr1-dps1-cp1-tp2-fsdp-mb8" not in [r["label"] for r in json.loads(out.read_text())]
    res = run([*pick, "--hardware", hw, "--pp", "2", "--tp", "2", "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.output  # a pipeline given: simulated, its bubble in the reason
    rows = json.loads(out.read_text())  # more microbatches: a smaller bubble, a lower peak
    assert [r["microbatches"] for r in rows] == [8, 4, None], [r["label"] for r in rows]
    assert rows[0]["label"] == "pp2-dpr1-dps1-cp1-tp2-fsdp-mb8" and rows[0]["flags"][-2:] == ["--microbatches", "8"]
    bubbles = [float(re.search(r"pipeline bubble ([0-9.]+) ms", r["why"]).group(1)) for r in rows]
    peaks = [r["ranks"][0]["prediction"]["peak_bytes"] for r in rows]
    assert bubbles == sorted(bubbles) and peaks == sorted(peaks), (bubbles, peaks)
    res = run([*pick, "--hardware", hw, "--pp", "2", "--tp", "2", "--microbatches", "2", "--json", str(out)])
    assert res.returncode == 0, res.output  # --microbatches given holds
    (row,) = json.loads(out.read_text())
    assert row["label"] == "pp2-dpr1-dps1-cp1-tp2-fsdp" and "pipeline bubble" in row["why"], row
    # activation checkpointing: without --ac each layout takes the least that fits (peaks of this layout's
    # rank, its norms fused as on a device: 59 MiB without, 50 selective, 31 full; 10% of the memory kept free)
    # (--microbatches 1: no gradient accumulation)
    one, whole = ["--tp", "2", "--dp-shard", "2", "--strategy", "fsdp", "--json", str(out)], ["--microbatches", "1"]
    for memory_gb, ac in ((0.06, "selective"), (0.05, "full")):
        res = run([*pick, "--hardware", _hardware_file(tmp_path / f"{ac}.json", memory_gb=memory_gb), *one, *whole])
        assert res.returncode == 0, res.output
        (row,) = json.loads(out.read_text())
        assert row["ac"] == ac and row["fits"], row
        assert (row["flags"][-2:] == ["--ac", ac]) if ac else ("--ac" not in row["flags"]), row
        assert f"pick: {' '.join(row['flags'])}" in res.stdout
    sim = [sys.executable, "-m", "mmm.plan.simulate", "--world", "4", "--max-iters", "2", "--ranks", "0"]
    sim += ["--hardware", str(tmp_path / "full.json"), *row["flags"], "--json", str(tmp_path / "one.json")]
    assert run(sim).returncode == 0  # the pick's flags as given: the same prediction
    assert json.loads((tmp_path / "one.json").read_text())[0]["prediction"]["step_s"] == row["step_s"]
    # without --microbatches, gradient accumulation is tried too: 2 microbatches with no AC (a peak of 39
    # MiB, the global batch kept) are predicted faster than full AC, and picked
    res = run([*pick, "--hardware", str(tmp_path / "full.json"), *one])
    assert res.returncode == 0, res.output
    (acc,) = json.loads(out.read_text())
    assert acc["label"].endswith("-mb2") and acc["flags"][-2:] == ["--microbatches", "2"] and acc["ac"] is None, acc
    assert acc["fits"] and "(2 microbatches accumulated)" in acc["why"] and acc["step_s"] < row["step_s"], acc
    res = run([*pick, "--hardware", str(tmp_path / "full.json"), *one, "--ac", "none", *whole])
    assert res.returncode == 0 and "pick: none; no layout fits in memory" in res.stdout, res.output  # both held
    (none,) = json.loads(out.read_text())
    assert acc["ranks"][0]["prediction"]["peak_bytes"] < 0.8 * none["ranks"][0]["prediction"]["peak_bytes"]
    small = _hardware_file(tmp_path / "small.json", memory_gb=0.03)  # the state fits, the step's peak not
    res = run([*pick, "--hardware", small, "--tp", "2", "--cp", "2", *whole], timeout=300)
    assert res.returncode == 0, res.output
    assert "DOES NOT FIT" in res.stdout and "pick: none; no layout fits in memory" in res.stdout
    tiny = _hardware_file(tmp_path / "tiny.json", memory_gb=1e-5)  # not even the state: nothing simulated
    res = run([*pick, "--hardware", tiny, "--tp", "2"], timeout=300)
    assert_clean_user_error(res, "no layout of 4 ranks fits in 0 GiB per device: the model's state alone does not")
    assert "3 of 3 layouts left out unsimulated" in res.output, res.output
    res = run([*pick, "--hardware", hw, "--strategy", "zero2"], timeout=60)
    assert_clean_user_error(res, "--pick: --strategy zero2 is not simulated")
    res = run([*pick[:-1], "--jobs", "2"], timeout=60)
    assert_clean_user_error(res, "--jobs 2 sets how many layouts --pick simulates at once; without --pick drop it")
    assert_clean_user_error(run([*pick[:-1], "--every"], timeout=60), "--every simulates every layout --pick ranks")


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # a thread may end while it is read
            out |= {int(c) for c in (task / "children").read_text().split()}
        except FileNotFoundError:
            pass
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except FileNotFoundError:
        return ""


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except FileNotFoundError:
        return math.inf  # ended: nothing to wait for
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_the_pick_spawns_no_more_processes_than_idle_cores(monkeypatch):
    """--pick's automatic --jobs: the cores the machine's load leaves idle (this process counted as its own),
    at least 1: on a busy machine more processes would only add their starts to the same cores."""
    from mmm.plan import ranking

    cores = len(os.sched_getaffinity(0))
    for load, want in ((0.0, cores), (1.0, cores), (cores + 8.0, 1), (cores - 0.5, min(cores, 2))):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert ranking._usable_cores() == want, (load, cores)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_pick_leaves_no_layout_simulating(tmp_path):
    """--pick simulates layouts in processes of its own: killed (as a launcher or a user kills it), it takes
    them with it at once, rather than leaving them to simulate for minutes on their own."""
    hw = _hardware_file(tmp_path / "hw.json")
    cmd = [sys.executable, "-m", "mmm.plan.simulate", "--world", "8", "--hardware", hw, "--pick", "--every"]
    cmd += ["--jobs", "2", "--dim", "1024", "--n-layers", "8", "--seq-len", "2048", "--batch-size", "16"]  # > 10 s each
    with spawn(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as p:
        workers: set[int] = set()
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.5)  # the pool's workers: spawned children running the simulations
            workers = {c for c in _children(p.pid) if "spawn_main" in _cmdline(c)}
        assert len(workers) >= 2, "the pick did not start its worker processes"
        while min(_cpu_s(w) for w in workers) < 6 and time.monotonic() < deadline:
            time.sleep(0.5)  # past their imports: each inside a layout's simulation
        os.kill(p.pid, signal.SIGKILL)  # no handler runs: only the kernel can end the workers
        p.wait()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [w for w in workers if _alive(w)]
        for w in left:
            os.kill(w, signal.SIGKILL)
        assert not left, f"{len(left)} worker(s) still simulating after the pick was killed"


def test_calibrate_measures_this_machine_for_the_simulator(tmp_path):
    hw = tmp_path / "cpu.json"
    model = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch-size", "4"]
    res = run([sys.executable, "-m", "mmm.plan.calibrate", "--ranks", "2", "--out", str(hw), *model], timeout=180)
    assert res.returncode == 0, res.output
    found = json.loads(hw.read_text())
    assert found["devices_per_node"] == 2 and found["peak_tflops"]["fp32"] > 0
    assert 0 < found["matmul_efficiency"] < 1 and found["intra_node_gbps"] > 0 and found["latency_us"] > 0
    res = run(
        [sys.executable, "-m", "mmm.plan.simulate", "--world", "2", "--hardware", str(hw), "--max-iters", "2", *model]
    )
    assert res.returncode == 0 and "predicted on this machine" in res.stdout, res.output
    calibrate = [sys.executable, "-m", "mmm.plan.calibrate", "--out", str(hw), *model]
    for flags, needle in [
        (["--ranks", "2", "--tp", "2", "--dtype", "bf16"], "--tp, --dtype: calibration measures the machine"),
        (["--ranks", "1"], "--ranks 1: bandwidth needs at least 2 ranks"),
        (["--ranks", "2", "--lr", "0.5", "--outdir", "o", "--wandb"], "--lr, --outdir, --wandb: calibration measures"),
        (["--ranks", "2", "--moe-experts", "2", "--moe-top-k", "3"], "--moe-top-k 3 must be between 1 and"),
    ]:
        assert_clean_user_error(run([*calibrate, *flags], timeout=60), needle)


def test_the_trainer_takes_the_planners_pick(tmp_path):
    """--pick-layout: rank 0 asks the planner, every rank trains on its pick, the log and summary.json say why."""
    hw = _hardware_file(tmp_path / "hw.json")
    # --strategy hsdp alone is refused (it needs --dp-replicate > 1): the run trains only on a pick's layout;
    # 6.5 MB per device: HSDP 2x2's step peaks at 7.8 MB with no AC (--ac none holds), 4.7 MB with gradient
    # accumulation's 2 microbatches
    fit = _hardware_file(tmp_path / "fit.json", memory_gb=0.0065)
    acc = ["--seq-len", "128", "--batch-size", "16", "--ac", "none"]
    args = ["-m", "mmm.examples.fsdp_tp", *tiny_llama(max_iters=2), *acc, "--strategy", "hsdp", "--pick-layout", fit]
    res = run_ranks(4, args, tmp_path / "out")
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    pick = s["layout_pick"]
    assert pick["hardware"] == "two per node" and pick["strategy"] == "hsdp"  # the given --strategy held
    assert s["mesh"] == pick["degrees"] and s["strategy"] == "hsdp" and s["mesh"]["dp_replicate"] >= 2
    assert pick["microbatches"] == 2 and pick["label"].endswith("-mb2") and pick["ac"] is None, pick
    assert s["accumulation"] == {"microbatches": 2}, s.get("accumulation")
    assert "gradient accumulation: 2 microbatches of 2 per rank" in res.output, res.output
    assert [r["step_s"] for r in pick["ranked"]] == sorted(r["step_s"] for r in pick["ranked"])
    assert f"layout: the planner picked {pick['label']} of {pick['layouts']} on two per node" in res.output
    # a pipeline given, its microbatches not: the planner's count is the one the pipeline runs (a model
    # whose bubble outweighs the per-message cost of more microbatches: 8 are predicted 1.29x faster than 2)
    wider = tiny_llama(max_iters=1, dim=256, seq_len=128)
    args = ["-m", "mmm.examples.fsdp_tp", *wider, "--pp", "2", "--tp", "2", "--pick-layout", hw]
    res = run_ranks(4, args, tmp_path / "pp")
    s = json.loads((tmp_path / "pp" / "summary.json").read_text())
    pick = s["layout_pick"]
    assert pick["microbatches"] == 8 and pick["label"].endswith("-mb8"), pick
    assert s["pipeline"]["microbatches"] == pick["microbatches"] and s["mesh"] == pick["degrees"]
    tiny = _hardware_file(tmp_path / "tiny.json", memory_gb=1e-5)
    small = [
        "-m",
        "mmm.examples.fsdp_tp",
        *tiny_llama(max_iters=2),
        "--pick-layout",
        tiny,
        "--outdir",
        str(tmp_path / "z"),
    ]
    res = run(launch("-n", "2", "python3", *small), timeout=120)
    assert_clean_user_error(res, f"--pick-layout {tiny}: no layout of 2 ranks fits in 0 GiB per device")
    assert not (tmp_path / "z" / "history.jsonl").exists()


def test_a_pipelines_last_stage_keeps_no_microbatchs_logits(tmp_path):
    """The schedule's last stage would keep every microbatch's output (the logits) until the step ends,
    for a merged output mmm does not read: by the end the whole batch's logits (Llama-3-8B at TP 2, 64
    microbatches of 8,192 tokens: 128 GiB). With 8 microbatches its simulated peak stays under them
    (kept, it is the batch's logits and more), and far under its peak with 2 (kept: nearly equal)."""
    vocab, seq, batch = 4096, 64, 8
    rises = {}
    for microbatches in (2, 8):
        out = tmp_path / f"{microbatches}.json"
        flags = ["--world", "2", "--pp", "2", "--microbatches", str(microbatches), "--ranks", "1", "--json", str(out)]
        model = ["--dim", "32", "--n-heads", "4", "--n-kv-heads", "2", "--n-layers", "2", "--vocab-size", str(vocab)]
        model += ["--seq-len", str(seq), "--batch-size", str(batch)]
        res = run([sys.executable, "-m", "mmm.plan.simulate", *flags, *model], timeout=180)
        assert res.returncode == 0, res.output
        (last,) = json.loads(out.read_text())
        rises[microbatches] = last["step"]["peak"]["total"] - last["step"]["peak"]["before_step"]
    logits = batch * seq * vocab * 4  # fp32
    assert 0 < rises[8] < logits and rises[8] < 0.5 * rises[2], (rises, logits)


@pytest.mark.parametrize("stages_per_rank", [1, 2])
def test_a_pipeline_rank_simulated_for_its_shapes_only_runs_no_step(stages_per_rank):
    """A pipeline rank's first step waits for its neighbours' shapes: the ranks of its pipeline are first
    simulated only as far as they send them, in sweeps down and up the pipeline (at most 4v - 2 with v
    stages per rank: 4 stages, 2 per rank, 6 sweeps of 4 ranks; a rank retried each time it waited cost
    the square of the stages, and at 16 stages of 2 per rank ran out of tries), then only the asked
    ranks' steps are counted (4 stages: 2 steps, not 4)."""
    code = """
import json, sys
import mmm.plan.fake as sim
from mmm.models.llama.recipe import command_line
tries, runs, steps = [], [], []
real, real_step = sim.fake_step, sim.train_step
def counted(*args, shapes_only=False, **kwargs):
    tries.append(shapes_only)
    out = real(*args, shapes_only=shapes_only, **kwargs)
    runs.append(shapes_only)  # a run that returned: not one that waited for shapes
    return out
def stepped(*args, **kwargs):
    steps.append(1)
    return real_step(*args, **kwargs)
sim.fake_step, sim.train_step = counted, stepped
config = command_line().parse(sys.argv[1:])
reports = sim.simulate_ranks(config, world=4, ranks=[0, 3])
pp = [r.step["comm_calls"]["pp"] for r in reports]
print(json.dumps({"tries": tries, "runs": runs, "steps": len(steps), "ranks": [r.rank for r in reports], "pp": pp}))
"""
    flags = ["--pp", "4", "--microbatches", "4", *tiny_llama(n_layers=8)]
    if stages_per_rank > 1:
        flags += ["--stages-per-rank", str(stages_per_rank), "--pp-schedule", "interleaved-1f1b"]
    res = run([sys.executable, "-c", code, *flags], timeout=180)
    assert res.returncode == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])
    # the middle stages' ranks once for their shapes, the asked ones (first and last) once for their step
    assert sorted(got["runs"]) == [False, False, True, True], got
    assert got["steps"] == 2, got  # the training steps run: the asked ranks' only
    assert got["tries"].count(True) <= (4 * stages_per_rank - 2) * 4, got
    assert got["ranks"] == [0, 3] and all(n > 0 for n in got["pp"]), got


def test_interleaved_pipeline_stages_are_simulated(tmp_path):
    """With 2 stages per rank, each pipeline rank waits on the other for its stages' shapes (a cycle the
    simulator's sweeps down and up the pipeline break); both ranks' steps are simulated."""
    out = tmp_path / "sim.json"
    flags = ["--world", "4", "--pp", "2", "--stages-per-rank", "2", "--pp-schedule", "interleaved-1f1b"]
    res = run([sys.executable, "-m", "mmm.plan.simulate", *flags, "--max-iters", "2", "--json", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 3] and all(r["coords"]["pp"] == r["rank"] // 2 for r in ranks)
    for r in ranks:  # 2 stages x 2 microbatches, activations forward and gradients back, over the pp group
        assert r["step"]["comm_calls"]["pp"] == 12 and r["step"]["comm_bytes"]["pp"] > 0


def test_a_helper_of_a_rank_carries_no_launcher_variables():
    from mmm.dist import without_launcher_vars

    env = {"OMPI_COMM_WORLD_RANK": "3", "PMI_RANK": "1", "SLURM_PROCID": "2", "RANK": "0", "MASTER_PORT": "1"}
    env |= {"MMM_WATCH": "h:1", "MMM_PID_DIR": "/x", "PATH": "/bin", "MMM_LOG_LEVEL": "INFO", "HOME": "/root"}
    assert without_launcher_vars(env) == {"PATH": "/bin", "MMM_LOG_LEVEL": "INFO", "HOME": "/root"}


@pytest.mark.parametrize("layout", [["--world", "1"], ["--world", "2", "--tp", "2"]], ids=["one-rank", "tp-only"])
def test_without_fsdp_bf16_and_the_optimizer_state_are_simulated(tmp_path, layout):
    """Without FSDP the forward runs under autocast: on meta it follows its inputs' device; bf16 halves
    what the matmuls save for backward (this fails if bf16 were silently off: the ratio would be 1)."""
    saved = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"{dtype}.json"
        flags = [*layout, *tiny_llama(), "--dtype", dtype, "--max-iters", "2", "--json", str(out)]
        res = run([sys.executable, "-m", "mmm.plan.simulate", *flags], timeout=180)
        assert res.returncode == 0, res.output
        rank = json.loads(out.read_text())[0]
        saved[dtype] = rank["step"]["activation_bytes"]
        # parameters not managed by FSDP are new objects once on fake tensors: the optimizer steps them
        assert rank["optim_bytes"] == 2 * rank["param_bytes"] > 0, rank
        assert rank["step"]["peak"]["before_step"] >= rank["param_bytes"] + rank["optim_bytes"], rank
    assert 0 < saved["bf16"] < 0.85 * saved["fp32"], saved  # fp32 beside: norms, the loss's log-softmax


def test_a_layout_simulated_by_blocks_equals_the_whole_model():
    """--pick simulates each layout at three and four blocks per stage and carries what grows per block
    on to the model's count: the same state, communication, activations, peak and step time as the
    whole model simulated (HSDP with full AC; a pipeline of 2 stages with TP, of 6 and 5 blocks;
    24 blocks whose peak moves: at the logits' gradient with few blocks, where backward starts with
    many, which a peak carried on from the two peaks alone put 10% low)."""
    layouts = [
        "4 --dp-replicate 2 --strategy hsdp --ac full --n-layers 6",
        "4 --pp 2 --tp 2 --n-layers 11 --split-points 6",
    ]
    layouts += ["4 --tp 2 --ac full --n-layers 24 --vocab-size 1024"]
    res = run([sys.executable, str(SCRIPTS / "by_blocks.py"), *layouts], timeout=300)
    assert res.returncode == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * len(layouts) and all(r["extrapolated"] for r in rows), res.stdout
    for r in rows:
        whole, blocks = r["whole"], r["blocks"]
        assert abs(blocks.pop("step_s") / whole.pop("step_s") - 1) < 1e-9, r
        assert blocks == whole, r


def test_the_floors_ring_attention_and_blocks_are_part_of_the_simulated_step():
    """--pick leaves out a context-parallel or pipeline layout whose floor is no faster than the best
    layout without either: the matmuls plus its ring attention (forward, backward, the forward again
    under full AC), or under a pipeline its blocks' memory-bound ops (one block, one microbatch), each
    simulated alone in a second. The ring's messages are the step's, byte for byte, its memory-bound
    ops a part of the step's, the blocks' too, and the floor under the predicted step (bf16; a pipeline
    of 4 microbatches too: the ring runs once per microbatch; a pipeline with TP, FSDP, full AC; one without FSDP,
    selective AC, uneven stages)."""
    layouts = ["8 --cp 2 --tp 2 --dp-shard 2", "8 --cp 2 --tp 2 --dp-shard 2 --ac full"]
    layouts += ["8 --pp 2 --cp 2 --tp 2 --dp-shard 1 --microbatches 4"]
    layouts += ["8 --pp 2 --cp 2 --tp 2 --dp-shard 1 --stages-per-rank 2 --pp-schedule interleaved-1f1b --n-layers 4"]
    pipelines = ["8 --pp 2 --tp 2 --dp-shard 2 --microbatches 4 --ac full"]
    # no FSDP (one dp rank: fp32 parameters under autocast), selective AC, stages of 3 and 2 blocks
    pipelines += ["4 --pp 2 --tp 2 --dp-shard 1 --ac selective --n-layers 5 --split-points 3"]
    res = run([sys.executable, str(SCRIPTS / "ring_floor.py"), *layouts, *pipelines], timeout=300)
    assert res.returncode == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(layouts) + len(pipelines), res.stdout
    for r in rows:
        assert 0 < r["floor_s"] < r["step_s"], r
        # the memory-bound ops decide: the ring's or the blocks' share of them under the step's, and a part of them
        assert r["slow_floor_s"] < r["slow_step_s"] and r["slow_floor_s"] > 0.2 * r["slow_memory_s"], r
    for r in rows[len(layouts) :]:
        assert 0.3 * r["memory_bytes"] < r["blocks_bytes"] < r["memory_bytes"], r
    rows = rows[: len(layouts)]
    for r in rows:
        ring = r["ring"]
        assert ring["comm_by_kind"] == {"p2p": r["cp_p2p_bytes"]} and r["cp_p2p_bytes"] > 0, r
        assert 0 < ring["comm_calls"] <= r["cp_calls"] and 0 < ring["memory_bytes"] < r["memory_bytes"], r
    plain, full, piped, _ = rows
    assert plain["ring"]["comm_calls"] == plain["cp_calls"]  # dp_shard 2: the cp group carries the ring alone
    assert full["cp_p2p_bytes"] == 1.5 * plain["cp_p2p_bytes"]  # the block's forward runs again in backward
    assert full["ring"]["memory_bytes"] > plain["ring"]["memory_bytes"]
    assert piped["cp_p2p_bytes"] == plain["cp_p2p_bytes"]  # the same tokens per rank, in 4 microbatches


def test_shapes_derived_on_global_fake_tensors_are_not_a_ranks_memory(tmp_path):
    """Under TP the loss runs in loss_parallel(), whose handlers derive output shapes by running the op
    on fake tensors of the global shape (the whole vocabulary). No rank holds those: the simulated peak
    stays under 5 copies of this rank's fp32 logits shard (the loss holds about 4: logits, log-softmax
    and their gradients); counting the derivation's whole-vocabulary tensors made it 5.4 (found on
    Llama-3-70B, whose phantom logits were 62 GiB of a 142 GiB peak)."""
    out = tmp_path / "sim.json"
    flags = ["--world", "2", "--tp", "2", "--dim", "64", "--n-heads", "4", "--n-layers", "1"]
    flags += ["--vocab-size", "32768", "--seq-len", "1024", "--batch-size", "1", "--ranks", "0"]
    res = run([sys.executable, "-m", "mmm.plan.simulate", *flags, "--json", str(out)], timeout=120)
    assert res.returncode == 0, res.output
    peak = json.loads(out.read_text())[0]["step"]["peak"]["total"]
    shard = 1024 * 32768 // 2 * 4  # this rank's fp32 logits: 1,024 tokens x half the vocabulary
    assert 4 * shard < peak < 5 * shard, peak / shard
