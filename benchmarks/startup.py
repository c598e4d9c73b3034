"""Startup time (launch to first finished step) of mmm's fsdp_tp trainer against a floor.

    python benchmarks/startup.py                       # 1, 2, 4, 8 ranks; torchrun and mpiexec; 3 repeats
    python benchmarks/startup.py --ranks 4 --launchers mpiexec --repeats 5

For every rank count and launcher it runs, alternately, the floor (benchmarks/startup_floor.py:
import torch, init gloo, one DDP step of the same model) and the trainer with ``--strategy ddp
--max-iters 1`` on the same model and batch, each started with the clock (``MMM_LAUNCH_TIME``) set
just before the launcher, and prints the median startup of each, their ratio (goal: <= 1.15), and
the trainer's median phases (interpreter start, imports, process group, mesh, model,
parallelize, first step). A `launch` row shows mmm's own launcher (which picks mpiexec or its local
spawner) running the trainer, against the mpiexec floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TRAINER = [
    "-m",
    "mmm.examples.fsdp_tp",
    "--strategy",
    "ddp",
    "--max-iters",
    "1",
    "--warmup",
    "0",
    "--no-plots",
    "--log-every",
    "1",
]


def _free_port() -> int:
    from mmm.dist import free_port

    return free_port()


def command(launcher: str, n: int, args: list[str]) -> list[str]:
    py = sys.executable
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *args]
    if launcher == "mpiexec":
        fwd = []
        for name in ("MASTER_ADDR", "MASTER_PORT", "MMM_LAUNCH_TIME", "OMP_NUM_THREADS", "PYTHONPATH"):
            fwd += ["-x", name]
        return [
            str(BIN / "mpiexec"),
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            *fwd,
            "-n",
            str(n),
            py,
            *args,
        ]
    if launcher == "launch":
        return [str(BIN / "launch"), "-q", "-n", str(n), py, *args]
    raise ValueError(launcher)


def one(kind: str, launcher: str, n: int, tmp: Path) -> dict:
    """One run; its startup seconds (and phases for the trainer)."""
    out = tmp / f"{kind}-{launcher}-{n}-{time.monotonic_ns()}"
    out.mkdir()
    if kind == "floor":
        args = [str(HERE / "startup_floor.py"), str(out / "floor.json")]
    else:
        args = [*TRAINER, "--outdir", str(out)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MMM_RICH": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    cmd = command(launcher, n, args)
    env["MMM_LAUNCH_TIME"] = repr(time.time())
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    if kind == "floor":
        return json.loads((out / "floor.json").read_text())
    s = json.loads((out / "summary.json").read_text())
    return {"startup_s": s["startup_s"], "phases": s["startup_phases"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4,8", help="rank counts, comma-separated [1,2,4,8]")
    p.add_argument("--launchers", default="torchrun,mpiexec,launch", help="[torchrun,mpiexec,launch]")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; medians reported [3]")
    p.add_argument("--json", default=None, help="also write the raw figures here")
    args = p.parse_args()
    ranks = [int(x) for x in args.ranks.split(",")]
    launchers = args.launchers.split(",")
    rows, raw = [], []
    with tempfile.TemporaryDirectory(prefix="mmm-startup-") as tmpdir:
        tmp = Path(tmpdir)
        for n in ranks:
            floors: dict[str, list[float]] = {}
            for launcher in launchers:
                floor_launcher = "mpiexec" if launcher == "launch" else launcher
                # launch's floor is mpiexec's: measured here unless mpiexec's row came first
                own_floor = launcher != "launch" or "mpiexec" not in floors
                mmm, phases = [], []
                for _ in range(args.repeats):
                    if own_floor:
                        floors.setdefault(floor_launcher, []).append(one("floor", floor_launcher, n, tmp)["startup_s"])
                    r = one("mmm", launcher, n, tmp)
                    mmm.append(r["startup_s"])
                    phases.append(r["phases"])
                floor = statistics.median(floors[floor_launcher]) if floors.get(floor_launcher) else float("nan")
                med = statistics.median(mmm)
                phase_med = {k[:-2]: statistics.median(ph[k] for ph in phases) for k in phases[0]}
                rows.append((n, launcher, floor, med, phase_med))
                raw.append(
                    {
                        "ranks": n,
                        "launcher": launcher,
                        "floor_s": floors.get(floor_launcher),
                        "mmm_s": mmm,
                        "phases": phases,
                    }
                )
                print(
                    f"  {n} ranks, {launcher}: floor {floor:.2f}s, mmm {med:.2f}s ({med / floor:.2f}x)",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\nstartup, launch to first finished step (median of {args.repeats}); {os.cpu_count()} cores; "
        "model: fsdp_tp defaults (dim 256, 4 blocks, seq 128, batch 16), DDP\n"
    )
    print("| ranks | launcher | floor (s) | mmm (s) | mmm / floor | mmm phases (s) |")
    print("|---|---|---|---|---|---|")
    for n, launcher, floor, med, ph in rows:
        phases = " ".join(f"{k} {v:.2f}" for k, v in ph.items())
        label = "launch (mmm) vs mpiexec floor" if launcher == "launch" else launcher
        print(f"| {n} | {label} | {floor:.2f} | {med:.2f} | {med / floor:.2f} | {phases} |")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
