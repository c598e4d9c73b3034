"""One GPU: the fsdp_tp trainer's step eager, compiled and in float8, against a plain torch loop with
the same speed habits, and the planner's prediction beside each eager run.

    python benchmarks/one_gpu.py                      # on a machine with one CUDA device
    python benchmarks/one_gpu.py --hardware h100 --out one_gpu.json

The model is the yardstick Llama (dim 2,048, 16 layers, 16 heads, vocabulary 32,000, sequences of 2,048,
batch 8: about 0.9 B parameters). Runs the trainer (one rank, ``python -m mmm.examples.fsdp_tp``) bf16
eager, bf16 + ``--compile`` and bf16 + ``--compile --float8`` (``--only`` picks others: ``fp32``, ``bf16+ac``,
``bf16+moe``, a mixture of experts of the same attention, predicted by the planner like the eager runs) and
reads each run's summary.json: the steady step (mean ``dt`` after the warmup), startup (launch to first
finished step), MFU against the device's dense bf16 peak (``mmm.flops``) and peak allocated memory.
Each run's twin in benchmarks/raw_one_gpu.py (the same model, batches and habits written with torch
alone) is measured right after it: the trainer's step over the plain loop's is what mmm costs (it
should stay <= 1.03); the plain loop without the habits (fp32 weights under autocast, torch's default
AdamW) shows what they bring. ``python -m mmm.plan.simulate --world 1 --hardware HARDWARE`` predicts
each eager run: step time and peak memory, printed as ratios to the measured ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmm.errors import UsageError, run_command

MODEL = ["--dim", "2048", "--n-layers", "16", "--n-heads", "16", "--vocab-size", "32000", "--seq-len", "2048"]
RUNS = {
    "bf16": ["--dtype", "bf16"],
    "bf16+compile": ["--dtype", "bf16", "--compile"],
    "bf16+compile+float8": ["--dtype", "bf16", "--compile", "--float8"],
    "fp32": ["--dtype", "fp32"],
    "bf16+ac": ["--dtype", "bf16", "--ac", "full"],
    # a mixture of experts: 8 experts of a quarter of the dense MLP's width, 2 per token (grouped matmuls on
    # CUDA 9.0+), measured against the planner's prediction; the plain loop has no twin of it
    "bf16+moe": ["--dtype", "bf16", "--moe-experts", "8", "--moe-top-k", "2", "--moe-hidden", "1408"],
}
DEFAULT_RUNS = ("bf16", "bf16+compile", "bf16+compile+float8")
RAW = Path(__file__).with_name("raw_one_gpu.py")


class Failed(Exception):
    pass


def run(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        print(p.stdout[-2000:], p.stderr[-4000:], sep="\n", file=sys.stderr)
        raise Failed(f"failed ({p.returncode}): {' '.join(cmd)}")
    return time.perf_counter() - t, p.stdout


def measure(name: str, job: list[str], steps: list[str], hardware: str, tmp: Path, env: dict) -> dict:
    """One trainer run's numbers from its summary.json, and (eager runs) the planner's prediction."""
    out = tmp / name
    trainer = [
        sys.executable,
        "-m",
        "mmm.examples.fsdp_tp",
        *job,
        *RUNS[name],
        *steps,
        "--outdir",
        str(out),
        "--no-plots",
    ]
    wall, _ = run(trainer, env)
    summary = json.loads(next(out.rglob("summary.json")).read_text())
    mem = summary["memory_per_rank"][0]
    row = {
        "run": name,
        "device": summary["flops"].get("device_name"),
        "step_s": summary["stats"]["dt"]["mean"],
        "step_std_s": summary["stats"]["dt"]["std"],
        "forward_s": summary["stats"]["dtf"]["mean"],
        "backward_s": summary["stats"]["dtb"]["mean"],
        "startup_s": summary["startup_s"],
        "wall_s": wall,
        "mfu": summary["mfu"],
        "peak_bytes": mem.get("peak_allocated_bytes"),
        "compiled_graphs": summary.get("compiled_graphs"),
        "final_loss": summary["final_loss"],
        "experts": summary.get("experts"),
    }
    if "--ac" not in RUNS[name] and "--moe-experts" not in RUNS[name]:  # the plain loop of the same step
        raw = [sys.executable, str(RAW), *job, *RUNS[name], "--iters", steps[1], "--profile", "0"]
        raw_json = tmp / f"{name}.raw.json"
        run([*raw, "--out", str(raw_json)], env)
        row["plain_step_s"] = json.loads(raw_json.read_text())["step_s"]
        if name == "bf16":  # and without the habits: what they bring
            run([*raw, "--habits", "none", "--out", str(raw_json)], env)
            row["plain_no_habits_step_s"] = json.loads(raw_json.read_text())["step_s"]
    if "--compile" not in RUNS[name]:  # the planner simulates the eager step
        sim = tmp / f"{name}.sim.json"
        planner = [sys.executable, "-m", "mmm.plan.simulate", "--world", "1", "--hardware", hardware]
        run([*planner, *job, *RUNS[name], "--json", str(sim)], env)
        rank = json.loads(sim.read_text())[0]
        p = rank["prediction"]
        row |= {"predicted_step_s": p["step_s"], "predicted_peak_bytes": p["peak_bytes"]}
        row |= {"predicted_matmul_s": p["matmul_s"], "predicted_memory_s": p["memory_s"]}
        row |= {"simulated_memory_bytes": rank["step"]["memory_bytes"]}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h100", help="the planner's preset or file for this device [h100]")
    ap.add_argument("--iters", type=int, default=30, help="steps per run [30]")
    ap.add_argument("--batch-size", type=int, default=8, help="global batch (sequences) [8]")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    ap.add_argument("--model", default=" ".join(MODEL), help=f"the model's flags [{' '.join(MODEL)}]")
    ap.add_argument(
        "--only", default=None, help=f"comma-separated runs of {', '.join(RUNS)} [{','.join(DEFAULT_RUNS)}]"
    )
    ns = ap.parse_args()
    if not cuda_device():
        raise UsageError(
            "benchmarks/one_gpu.py measures one CUDA device's step (a 0.9 B-parameter model by default) and found "
            "none here (torch.cuda.is_available() is False): run it on a GPU machine"
        )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    job = [*ns.model.split(), "--batch-size", str(ns.batch_size)]  # what the planner simulates
    steps = ["--max-iters", str(ns.iters), "--warmup", "5"]
    rows: list[dict] = []
    names = ns.only.split(",") if ns.only else list(DEFAULT_RUNS)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                rows.append(measure(name, job, steps, ns.hardware, Path(tmp), env))
            except Failed as e:  # the other runs still say something
                print(f"{name}: {e}", file=sys.stderr)
                continue
            print(json.dumps(rows[-1]), flush=True)
    if not rows:
        return 1
    base = rows[0]
    print(
        f"\n{'run':<20}{'step ms':>9}{'x ' + base['run']:>10}{'MFU':>7}{'/plain':>8}{'peak GiB':>10}{'startup s':>11}"
        f"{'graphs':>8}{'pred/meas step':>16}{'pred/meas peak':>16}"
    )
    for r in rows:
        plain = f"{r['step_s'] / r['plain_step_s']:.3f}" if r.get("plain_step_s") else "-"
        pred_step = f"{r['predicted_step_s'] / r['step_s']:.2f}" if "predicted_step_s" in r else "-"
        pred_peak = (
            f"{r['predicted_peak_bytes'] / r['peak_bytes']:.3f}"
            if r.get("peak_bytes") and "predicted_peak_bytes" in r
            else "-"
        )
        print(
            f"{r['run']:<20}{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>10.2f}{r['mfu']:>7.1%}{plain:>8}"
            f"{(r['peak_bytes'] or 0) / 2**30:>10.2f}{r['startup_s']:>11.1f}{r['compiled_graphs'] or 0:>8}"
            f"{pred_step:>16}{pred_peak:>16}"
        )
    for r in rows:
        if r.get("plain_no_habits_step_s"):
            print(
                f"plain loop without the habits: {r['plain_no_habits_step_s'] * 1e3:.1f} ms; the trainer's {r['run']} "
                f"step is {r['plain_no_habits_step_s'] / r['step_s']:.2f}x faster"
            )
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def cuda_device() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    run_command(main, "python benchmarks/one_gpu.py")
