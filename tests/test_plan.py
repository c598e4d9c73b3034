"""The planner (python -m mmm.plan): layouts, reasons, and estimates checked against measured runs."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import assert_clean_user_error, run, run_ranks

from mmm.parallel.plan import plan

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
    assert {"pp1-dpr1-dps4-cp1-tp1-ddp", "pp1-dpr1-dps2-cp1-tp2-fsdp", "pp1-dpr2-dps2-cp1-tp1-hsdp",
            "pp2-dpr1-dps2-cp1-tp1-fsdp", "pp1-dpr1-dps4-cp1-tp1-zero3"} <= valid
    by_label = {c.label: c for c in combos}
    assert any("DDP cannot hold sharded" in p for p in by_label["pp1-dpr1-dps2-cp1-tp2-ddp"].problems)
    assert any("needs --strategy hsdp" in p for p in by_label["pp1-dpr2-dps2-cp1-tp1-fsdp"].problems)
    for c in combos:
        assert c.valid == (c.memory is not None), c.label
        assert c.valid or c.problems


def test_model_flags_change_validity_and_estimates():
    # 6 heads cannot be split over tp=4; a longer sequence costs more activation memory
    combos = {c.label: c for c in plan(4, n_heads=6, dim=192)}
    assert any("n-heads" in p or "heads" in p for p in combos["pp1-dpr1-dps1-cp1-tp4-fsdp"].problems)
    short = {c.label: c for c in plan(2, seq_len=64)}["pp1-dpr1-dps2-cp1-tp1-fsdp"]
    long = {c.label: c for c in plan(2, seq_len=128)}["pp1-dpr1-dps2-cp1-tp1-fsdp"]
    assert long.memory["activation_bytes"] > 1.9 * short.memory["activation_bytes"]


@pytest.mark.parametrize("label", [
    "pp1-dpr1-dps2-cp1-tp2-fsdp",
    "pp1-dpr1-dps1-cp2-tp2-fsdp",
    "pp1-dpr2-dps2-cp1-tp1-hsdp",
    "pp2-dpr1-dps2-cp1-tp1-fsdp",
])
def test_estimates_match_measured(tmp_path, label):
    combo = {c.label: c for c in plan(4, max_iters=2, measure=True)}[label]
    run_ranks(4, [*FSDP_TP, *combo.flags], tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    measured = s["measured_per_rank"]
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
        act = max(m["activation_bytes"] for m in measured)
        assert abs(act / combo.memory["activation_bytes"] - 1) <= ACT_TOL, (act, combo.memory)


def test_cli_lists_table_invalid_reasons_and_json(tmp_path):
    out = tmp_path / "plan.json"
    res = run([sys.executable, "-m", "mmm.plan", "--world", "4", "--tp", "2", "--json", str(out)])
    assert res.returncode == 0, res.output
    assert "valid layouts" in res.stdout and "comm:tp" in res.stdout
    assert "invalid layouts" in res.stdout and "DDP cannot hold sharded" in res.stdout
    rows = json.loads(out.read_text())
    assert rows and all(r["tp"] == 2 for r in rows)
    assert any(r["valid"] and r["memory"]["total_bytes"] > 0 for r in rows)


@pytest.mark.parametrize("flags, needles", [
    (["--world", "0"], ["--world", "0"]),
    (["--world", "4", "--tp", "3"], ["tp=3"]),
    (["--world", "4", "--tp", "2", "--strategy", "ddp"], ["ddp", "tp=2"]),
    (["--world", "4", "--strategies", "fsdp,zero9"], ["zero9"]),
])
def test_cli_bad_input(flags, needles):
    res = run([sys.executable, "-m", "mmm.plan", *flags], timeout=60)
    assert res.returncode == 2
    assert_clean_user_error(res, *needles)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
