"""Simulated ranks against real ones: communication, saved activations and state, layout by layout.

    .venv/bin/python benchmarks/simulate_vs_measured.py [--layouts NAME,...] [--out DIR]

For each layout the fsdp_tp trainer runs for real under ``launch`` (gloo, two steps, ``--measure``
watching step 2) and ``python -m mmm.plan.simulate`` simulates every rank of the same job on a
fake process group (one steady step on fake tensors). Per layout the table gives, over all ranks,
the worst ratio simulated / measured of: payload bytes per mesh axis (and whether every axis's call
count is the same), bytes saved for backward, and parameter + gradient + AdamW bytes. 1.000 is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["--dim", "128", "--n-layers", "2", "--n-heads", "4", "--seq-len", "64", "--batch-size", "8"]
COMMON = ["--max-iters", "2", "--warmup", "0", "--measure", "--no-plots", *MODEL]
LAYOUTS = {  # name: (ranks, flags)
    "fsdp-dp4": (4, []),
    "hsdp-2x2": (4, ["--strategy", "hsdp", "--dp-replicate", "2"]),
    "fsdp-dp2-tp2": (4, ["--tp", "2"]),
    "tp4": (4, ["--tp", "4"]),
    "fsdp-dp2-cp2": (4, ["--cp", "2"]),
    "cp2-tp2": (4, ["--cp", "2", "--tp", "2"]),
    "fsdp-dp2-tp2-ac": (4, ["--tp", "2", "--ac", "full"]),
    "fsdp-dp4-bf16": (4, ["--dtype", "bf16"]),
    "hsdp-2x2-tp2": (8, ["--strategy", "hsdp", "--dp-replicate", "2", "--tp", "2"]),
    "dp2-cp2-tp2": (8, ["--cp", "2", "--tp", "2"]),
    "fsdp-dp2-tp4": (8, ["--tp", "4"]),
}
STATE = ("param_bytes", "grad_bytes", "optim_bytes")


def compare(real: dict, simulated: list[dict]) -> dict:
    comm, calls_equal, act, state = [], True, [], []
    for measured, memory, sim in zip(real["measured_per_rank"], real["memory_per_rank"], simulated, strict=True):
        step = sim["step"]
        calls_equal &= step["comm_calls"] == measured["comm_calls"]
        for axis in set(measured["comm_bytes"]) | set(step["comm_bytes"]):
            m, s = measured["comm_bytes"].get(axis, 0), step["comm_bytes"].get(axis, 0)
            comm.append(s / m if m else (1.0 if s == 0 else float("inf")))
        act.append(step["activation_bytes"] / measured["activation_bytes"])
        state.append(sum(sim[k] for k in STATE) / sum(memory[k] for k in STATE))
    worst = lambda xs: max(xs, key=lambda x: abs(x - 1))  # noqa: E731
    return {"comm": worst(comm), "calls_equal": calls_equal, "activations": worst(act), "state": worst(state)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    p.add_argument("--out", type=Path, default=None, help="keep the runs here [a temporary folder]")
    args = p.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")
    root = args.out or Path(tempfile.mkdtemp(prefix="mmm-simulate-vs-measured-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMM_LOG_LEVEL": "WARNING", "MMM_RICH": "0"}
    bindir = Path(sys.executable).parent
    rows = []
    for name in names:
        ranks, flags = LAYOUTS[name]
        out = root / name
        trainer = ["-m", "mmm.examples.fsdp_tp", *COMMON, *flags]
        real = [str(bindir / "launch"), "-q", "-n", str(ranks), sys.executable, *trainer, "--outdir", str(out)]
        sim_json = root / f"{name}.simulated.json"
        everyone = ",".join(str(r) for r in range(ranks))
        sim = [sys.executable, "-m", "mmm.plan.simulate", "--world", str(ranks), "--ranks", everyone]
        sim += ["--json", str(sim_json), *trainer[2:]]
        for cmd in (real, sim):
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if res.returncode != 0:
                raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
        found = compare(json.loads((out / "summary.json").read_text()), json.loads(sim_json.read_text()))
        rows.append((name, ranks, found))
        print(f"  {name}: {found}", file=sys.stderr, flush=True)
    print("\nsimulated / measured, worst rank and mesh axis of each layout (1.000 = exact)\n")
    print("| layout | ranks | comm bytes | same calls | saved activations | params+grads+AdamW |")
    print("|---|---:|---:|---|---:|---:|")
    for name, ranks, f in rows:
        print(
            f"| {name} | {ranks} | {f['comm']:.3f} | {'yes' if f['calls_equal'] else 'NO'} | "
            f"{f['activations']:.3f} | {f['state']:.3f} |"
        )
    exact = sum(f["comm"] == 1.0 and f["calls_equal"] for _, _, f in rows)
    within = sum(abs(f["activations"] - 1) <= 0.10 and abs(f["state"] - 1) <= 0.10 for _, _, f in rows)
    print(f"\ncommunication exact in {exact} of {len(rows)} layouts; memory within 10% in {within} of {len(rows)}")
    (root / "results.json").write_text(json.dumps([{"layout": n, "ranks": r, **f} for n, r, f in rows], indent=1))
    print(f"data: {root}")


if __name__ == "__main__":
    main()
