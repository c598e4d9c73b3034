"""The planner's predicted step times against a sweep's measured ones, on this machine.

    .venv/bin/python benchmarks/predict_vs_sweep.py --world 4 [--out DIR] [fsdp_tp model flags]

1. calibrates this machine for --world ranks (``python -m mmm.plan.calibrate``: matmul FLOP/s, a
   training step's efficiency, gloo bandwidth and latency);
2. ranks every layout the simulator runs (fsdp/hsdp, pipelines included) by predicted step time on that file
   (``python -m mmm.plan.simulate --pick``), as the sweep runs them: activation checkpointing as given
   (``--ac none`` unless the model flags say), pipelines at the trainer's default microbatches (the
   pick's variants with more microbatches are left out: the sweep does not run them);
3. runs each of them for real (``benchmarks/sweep.py``: one ``launch`` run per layout, mean step time);
4. prints predicted against measured per layout, the Spearman rank correlation, and the measured
   step time of the planner's pick over the measured fastest's (1.00 = it picked the fastest).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--dim", "256", "--n-layers", "4", "--n-heads", "8", "--seq-len", "256", "--batch-size", "8"]


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):  # ties share their mean rank
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SystemExit(f"failed (exit {res.returncode}): {' '.join(cmd)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--max-iters", type=int, default=12, help="steps of each real run [12]")
    p.add_argument(
        "--reuse", action="store_true", help="keep OUT's calibration and sweep when there (re-rank and compare only)"
    )
    args, model = p.parse_known_args()
    model = model or MODEL
    root = args.out or Path(tempfile.mkdtemp(prefix="mmm-predict-vs-sweep-"))
    if (root / "sweep").exists() and not args.reuse:
        raise SystemExit(
            f"--out {root} holds an earlier comparison: --reuse compares again with its calibration and sweep, "
            "or give another --out (nothing there is overwritten)"
        )
    root.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    hw = root / "cpu.json"
    if not (args.reuse and hw.exists()):
        run([py, "-m", "mmm.plan.calibrate", "--ranks", str(args.world), "--out", str(hw), *model])
    picked = root / "ranked.json"
    sim = [py, "-m", "mmm.plan.simulate", "--world", str(args.world), "--hardware", str(hw), "--pick", "--every"]
    given_ac = any(a == "--ac" or a.startswith("--ac=") for a in model)
    held = [] if given_ac else ["--ac", "none"]  # the sweep runs each layout as given: AC held
    run([*sim, "--json", str(picked), *held, *model])
    # the sweep runs a pipeline at the trainer's default microbatches: the pick among those is compared
    ranked = [r for r in json.loads(picked.read_text()) if r["microbatches"] is None]
    combos = ",".join(r["label"] for r in ranked)
    sweep = root / "sweep"
    if not (args.reuse and (sweep / "results.nc").exists()):
        run(
            [py, "benchmarks/sweep.py", "--world", str(args.world), "--combos", combos, "--out", str(sweep)]
            + ["--max-iters", str(args.max_iters), *model]
        )
    import xarray as xr

    ds = xr.open_dataset(sweep / "results.nc")
    measured = {str(c): float(ds["dt"].sel(combo=c)) for c in ds["combo"].values}
    rows = [(r["label"], r["step_s"], measured[r["label"]]) for r in ranked if r["label"] in measured]
    fastest = min(m for _, _, m in rows)
    pick = ranked[0]["label"]
    print(f"\npredicted (calibrated: {json.loads(hw.read_text())['source']}) against measured, {args.world} ranks\n")
    print("| layout | predicted ms | measured ms | measured / predicted | measured / fastest |")
    print("|---|---:|---:|---:|---:|")
    for label, pred, meas in rows:
        star = " (pick)" if label == pick else ""
        print(f"| {label}{star} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {meas / pred:.2f} | {meas / fastest:.2f} |")
    rho = spearman([p for _, p, _ in rows], [m for _, _, m in rows])
    print(
        f"\nSpearman rank correlation {rho:.2f} over {len(rows)} layouts; the pick's measured step is "
        f"{measured[pick] / fastest:.2f}x the fastest's"
    )
    (root / "comparison.json").write_text(
        json.dumps({"spearman": rho, "pick": pick, "pick_over_fastest": measured[pick] / fastest, "rows": rows})
    )


if __name__ == "__main__":
    main()
