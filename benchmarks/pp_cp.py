"""Pipeline bubble and context-parallel scaling of the fsdp_tp trainer, measured in one run.

    .venv/bin/python benchmarks/pp_cp.py [--what bubble|cp|both] [--iters 8] [--outdir DIR]

bubble: pp=4 (GPipe) with 1, 4 and 8 microbatches. Each step time is divided by the ideal
        no-bubble time, a single process's step time of the same model and batch / 4, and
        printed next to the schedule's ideal ratio (m + p - 1) / m.
cp:     step time of cp=2 and cp=4 against cp=1 at the same global sequence length.

Every figure is the warmup-excluded mean dt from the run's summary.json. On a machine with
fewer cores than ranks the ranks share cores, so ratios there measure time-slicing as much as
the schedule: the script prints the core count beside the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mmm.cli import positive_int
from mmm.errors import ArgumentParser, UsageError, run_command

LAUNCH = str(Path(sys.executable).parent / "launch")


def run(n: int, flags: list[str], out: Path) -> float:
    cmd = [sys.executable] if n == 1 else [LAUNCH, "-q", "-n", str(n), sys.executable]
    cmd += ["-m", "mmm.examples.fsdp_tp", *flags, "--no-plots", "--outdir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())["stats"]["dt"]["mean"]


def bubble(root: Path, iters: int) -> None:
    model = ["--dim", "256", "--n-layers", "8", "--seq-len", "128", "--batch-size", "16", "--max-iters", str(iters)]
    single = run(1, [*model, "--dp-shard", "1"], root / "single")
    p = 4
    print(
        f"\npipeline bubble, pp={p} GPipe, {model[1]}-wide {model[3]}-block Llama, batch 16 x 128; "
        f"one process: dt {single:.4f}s; {os.cpu_count()} cores\n"
    )
    print("| microbatches | dt s | dt / (single / p) | ideal (m + p - 1) / m |")
    print("|---|---|---|---|")
    for m in (1, 4, 8):
        dt = run(p, [*model, "--pp", str(p), "--pp-schedule", "gpipe", "--microbatches", str(m)], root / f"pp{p}_m{m}")
        print(f"| {m} | {dt:.4f} | {dt / (single / p):.2f} | {(m + p - 1) / m:.2f} |")


def cp_scaling(root: Path, iters: int) -> None:
    model = ["--dim", "128", "--n-layers", "2", "--seq-len", "1024", "--batch-size", "2", "--max-iters", str(iters)]
    base = run(1, [*model, "--dp-shard", "1"], root / "cp1")
    print(f"\ncontext parallel, global sequence 1024, batch 2; {os.cpu_count()} cores\n")
    print("| cp | dt s | ratio to cp=1 |")
    print("|---|---|---|")
    print(f"| 1 | {base:.4f} | 1.00 |")
    for cp in (2, 4):
        dt = run(cp, [*model, "--cp", str(cp), "--dp-shard", "1"], root / f"cp{cp}")
        print(f"| {cp} | {dt:.4f} | {dt / base:.2f} |")


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", choices=["bubble", "cp", "both"], default="both")
    ap.add_argument("--iters", type=positive_int, default=8, help="steps of each run [8]")
    ap.add_argument("--outdir", type=Path, default=None, help="a new folder for the runs [a temporary one]")
    args = ap.parse_args()
    if args.outdir is not None and args.outdir.is_dir() and any(args.outdir.iterdir()):
        raise UsageError(f"--outdir {args.outdir} holds earlier runs: give a new one (each run needs its own folder)")
    root = args.outdir or Path(tempfile.mkdtemp(prefix="pp-cp-"))
    if args.what in ("bubble", "both"):
        bubble(root, args.iters)
    if args.what in ("cp", "both"):
        cp_scaling(root, args.iters)
    print(f"\nruns in {root}")


if __name__ == "__main__":
    run_command(main, "python benchmarks/pp_cp.py")
