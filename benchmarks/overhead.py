"""mmm's overhead: the fsdp_tp trainer's step time against the same model and plan by hand.

    python benchmarks/overhead.py                   # 4 ranks, tp=2 x dp=2, 40 steps, 3 pairs, under launch
    python benchmarks/overhead.py --tp 4 --repeats 5 --launcher torchrun

Runs, alternately on the same ranks (``launch``: mpiexec where there is one; or torchrun),
`python -m mmm.examples.fsdp_tp` and benchmarks/raw_fsdp_tp.py (init_device_mesh +
parallelize_module + fully_shard + a plain loop of data, forward, backward and optimizer step
only), same model, data, seed, weights and mesh. dt is measured the same way in both: the wall time
of the whole loop iteration, from the end of one to the end of the next (everything the trainer
does per step: data, forward, backward, gradient norm, its one packed all-reduce, optimizer step,
History); the first --warmup steps are left out. Prints each pair, the median ratio
mmm / raw (goal: <= 1.03), and the largest relative difference between their loss curves (the
two must compute the same thing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def ranks_command(launcher: str, n: int, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    return [sys.executable, "-m", "mmm.launch", "-n", str(n), sys.executable, *args]


def run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMM_RICH": "0"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="ranks of both runs [4]")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree; dp is ranks / tp [2]")
    p.add_argument("--steps", type=int, default=40, help="steps of each run [40]")
    p.add_argument(
        "--launcher", choices=("launch", "torchrun"), default="launch", help="launch: mpiexec where there is one"
    )
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of each run's mean dt [5]")
    p.add_argument("--repeats", type=int, default=3, help="mmm/raw pairs, alternated; the median is reported [3]")
    args = p.parse_args()
    model = [
        "--dim",
        "256",
        "--n-layers",
        "4",
        "--seq-len",
        "128",
        "--batch-size",
        "16",
        "--max-iters",
        str(args.steps),
    ]
    ratios, mmm_dts, raw_dts, loss_diff = [], [], [], 0.0
    with tempfile.TemporaryDirectory(prefix="mmm-overhead-") as tmpdir:
        tmp = Path(tmpdir)
        for i in range(args.repeats):
            out = tmp / f"mmm{i}"
            run(
                ranks_command(
                    args.launcher,
                    args.ranks,
                    [
                        "-m",
                        "mmm.examples.fsdp_tp",
                        "--tp",
                        str(args.tp),
                        *model,
                        "--no-plots",
                        "--log-every",
                        "1000",
                        "--outdir",
                        str(out),
                    ],
                )
            )
            rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
            mmm = statistics.mean(r["dt"] for r in rows[args.warmup :])
            run(
                ranks_command(
                    args.launcher,
                    args.ranks,
                    [str(HERE / "raw_fsdp_tp.py"), "--tp", str(args.tp), *model, "--out", str(tmp / f"raw{i}.json")],
                )
            )
            raw_run = json.loads((tmp / f"raw{i}.json").read_text())
            raw = statistics.mean(raw_run["dt"][args.warmup :])
            loss_diff = max(loss_diff, max(abs(a["loss"] - b) / abs(b) for a, b in zip(rows, raw_run["loss"])))
            mmm_dts.append(mmm)
            raw_dts.append(raw)
            ratios.append(mmm / raw)
            print(
                f"  pair {i + 1}: mmm dt {mmm:.4f}s, raw dt {raw:.4f}s, ratio {mmm / raw:.3f}",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"\noverhead, {args.ranks} ranks (tp={args.tp} x dp={args.ranks // args.tp}) under {args.launcher}, "
        f"fsdp_tp default model, {args.steps} steps ({args.warmup} warmup), {os.cpu_count()} cores\n"
    )
    print("| | mmm dt (s) | raw torch dt (s) | mmm / raw |")
    print("|---|---|---|---|")
    for i, (a, b) in enumerate(zip(mmm_dts, raw_dts), 1):
        print(f"| pair {i} | {a:.4f} | {b:.4f} | {a / b:.3f} |")
    print(
        f"| median | {statistics.median(mmm_dts):.4f} | {statistics.median(raw_dts):.4f} | "
        f"{statistics.median(ratios):.3f} |"
    )
    print(f"\nloss curves: max relative difference {loss_diff:.2e} (same model, data and plan)")


if __name__ == "__main__":
    main()
