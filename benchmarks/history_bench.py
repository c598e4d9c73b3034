"""History overhead: `update` with 8 scalars (median, p90 in microseconds) and `finalize` of N steps.

    .venv/bin/python benchmarks/history_bench.py [--steps 10000] [--outdir /tmp/hist-bench]

Goals (issue 3): update median <= 20 us; finalize of 10,000 steps <= 5 s including plots.
Printed next to the cost of the bare json.dumps + write the update has to do anyway.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mmm.errors import ArgumentParser, run_command
from mmm.history import History

KEYS = ("loss", "dt", "dtf", "dtb", "tps", "lr", "grad_norm", "mem")


def bench_update(outdir: Path, steps: int, as_tensors: bool) -> list[float]:
    h = History(outdir, warmup=2)
    vals = [torch.tensor(float(i)) for i in range(len(KEYS))] if as_tensors else [float(i) for i in range(len(KEYS))]
    times = []
    for i in range(steps):
        kw = dict(zip(KEYS, vals))
        t0 = time.perf_counter_ns()
        h.update(i, **kw)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return h, times


def steps_count(text: str) -> int:
    """At least 2 steps: the p90 needs two samples."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; use a step count such as 10000") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} is too few: the p90 needs at least 2 steps (e.g. 10000)")
    return value


def main() -> None:
    p = ArgumentParser(prog="python benchmarks/history_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=steps_count, default=10_000, metavar="N", help="steps to time (>= 2) [10000]")
    p.add_argument(
        "--outdir", type=Path, default=None, metavar="DIR", help="output folder, made if missing [a new temp dir]"
    )
    args = p.parse_args()
    root = args.outdir or Path(tempfile.mkdtemp(prefix="hist-bench-"))
    if root.exists() and not root.is_dir():
        p.error(f"--outdir {str(root)!r} is a file; pass a folder (it is made if missing)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--outdir {str(root)!r} cannot be made ({e.strerror}); pass a writable folder")

    # baseline: what one jsonl line costs with no History around it
    f = open(root / "baseline.jsonl", "w", buffering=1)
    base = []
    for i in range(args.steps):
        rec = {"iter": i, **{k: float(j) for j, k in enumerate(KEYS)}}
        t0 = time.perf_counter_ns()
        f.write(json.dumps(rec) + "\n")
        base.append((time.perf_counter_ns() - t0) / 1e3)
    f.close()
    b_med = statistics.median(base)
    print(f"baseline json.dumps+write: median {b_med:.2f} us")
    for as_tensors in (False, True):
        h, times = bench_update(root / ("tensors" if as_tensors else "floats"), args.steps, as_tensors)
        med = statistics.median(times)
        p90 = statistics.quantiles(times, n=10)[-1]
        kind = "0-d tensors" if as_tensors else "floats"
        print(
            f"update, 8 {kind}: median {med:.2f} us, p90 {p90:.2f} us ({med / b_med:.2f}x baseline) "
            f"[goal <= 20 us: {'ok' if med <= 20 else 'MISSED'}]"
        )
        t0 = time.perf_counter()
        h.finalize({"bench": True}, print_plots=False)
        fin = time.perf_counter() - t0
        print(
            f"finalize {args.steps} steps ({kind}), netCDF + summary + {len(KEYS)} text and {len(KEYS)} png plots: "
            f"{fin:.2f} s [goal <= 5 s: {'ok' if fin <= 5 else 'MISSED'}]"
        )
    print(f"outputs in {root}")


if __name__ == "__main__":
    run_command(main, "python benchmarks/history_bench.py")
