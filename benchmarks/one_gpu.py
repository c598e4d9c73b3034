"""One GPU: the fsdp_tp trainer's CUDA paths measured, and the planner's prediction beside each.

    python benchmarks/one_gpu.py                      # on a machine with one CUDA device
    python benchmarks/one_gpu.py --hardware h100 --out one_gpu.json

Runs the trainer (one rank, ``python -m mmm.examples.fsdp_tp``) on the same model in four ways: fp32,
bf16, bf16 + ``--compile``, bf16 + ``--ac full``, and reads each run's summary.json: the steady step
(mean ``dt`` after the warmup), startup (launch to first finished step), MFU and the device's peak
allocated memory. Each feature shows in the numbers when it is on: bf16 against fp32 (speed, memory),
compile against eager (speed, captured graphs), activation checkpointing against none (memory down,
time up). Then ``python -m mmm.plan.simulate --world 1 --hardware HARDWARE`` predicts each eager run:
step time and peak memory, printed as ratios to the measured ones (compile is not simulated).
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

MODEL = ["--dim", "1024", "--n-layers", "12", "--n-heads", "16", "--vocab-size", "32000", "--seq-len", "1024"]
RUNS = {
    "fp32": ["--dtype", "fp32"],
    "bf16": ["--dtype", "bf16"],
    "bf16+compile": ["--dtype", "bf16", "--compile"],
    "bf16+ac": ["--dtype", "bf16", "--ac", "full"],
}


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
    }
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
    ap.add_argument("--batch-size", type=int, default=16, help="global batch (sequences) [16]")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    ap.add_argument("--model", default=" ".join(MODEL), help=f"the model's flags [{' '.join(MODEL)}]")
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(RUNS))
    ns = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    job = [*ns.model.split(), "--batch-size", str(ns.batch_size)]  # what the planner simulates
    steps = ["--max-iters", str(ns.iters), "--warmup", "5"]
    rows: list[dict] = []
    names = ns.only.split(",") if ns.only else list(RUNS)
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
        f"\n{'run':<14}{'step ms':>9}{'x ' + base['run']:>10}{'MFU':>7}{'peak GiB':>10}{'startup s':>11}"
        f"{'graphs':>8}{'pred/meas step':>16}{'pred/meas peak':>16}"
    )
    for r in rows:
        pred_step = f"{r['predicted_step_s'] / r['step_s']:.2f}" if "predicted_step_s" in r else "-"
        pred_peak = (
            f"{r['predicted_peak_bytes'] / r['peak_bytes']:.3f}"
            if r.get("peak_bytes") and "predicted_peak_bytes" in r
            else "-"
        )
        print(
            f"{r['run']:<14}{r['step_s'] * 1e3:>9.1f}{r['step_s'] / base['step_s']:>10.2f}{r['mfu']:>7.1%}"
            f"{(r['peak_bytes'] or 0) / 2**30:>10.2f}{r['startup_s']:>11.1f}{r['compiled_graphs'] or 0:>8}"
            f"{pred_step:>16}{pred_peak:>16}"
        )
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
