"""A mixture of experts against the dense model of the same active parameters, and all-to-all
(Ulysses) against ring context parallel, measured in one run of the fsdp_tp trainer on CPU ranks.

    .venv/bin/python benchmarks/moe_cp.py [--what moe|cp|both] [--iters 8] [--ranks 4] [--outdir DIR]

moe: the dense Llama, then the same Llama with 8 experts of top-2 whose expert width is the dense
     width / 2 (the same active parameters per token, 4x the feed-forward parameters), on --ranks
     ranks: FSDP alone, then expert parallel 2 and 4. Per layout: tokens/s and its ratio to the
     dense run, the step time, peak host memory (max rank), model state per rank, and the bytes
     each mesh group moved on step 2 (``--measure``: the all-to-all's are the ep group's).
cp:  ring and all-to-all attention at cp 2 and 4 (one sequence of 1024 tokens split over the
     ranks), step time and bytes moved by the cp group, against one process.

Every figure is from the run's summary.json (warmup-excluded means over the whole loop). On a
machine with fewer cores than ranks the ranks share cores, so ratios there measure time-slicing as
much as the layout: the core count is printed beside the tables.
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


def run(n: int, flags: list[str], out: Path) -> dict:
    cmd = [sys.executable] if n == 1 else [LAUNCH, "-q", "-n", str(n), sys.executable]
    cmd += ["-m", "mmm.examples.fsdp_tp", *flags, "--no-plots", "--log-every", "1000", "--outdir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def groups(summary: dict) -> str:
    """MiB rank 0 moved on the measured step, by mesh group."""
    comm = (summary.get("measured_per_rank") or [{}])[0].get("comm_bytes", {})
    return ", ".join(f"{name} {mib(float(b))}" for name, b in sorted(comm.items())) or "-"


def moe(root: Path, iters: int, ranks: int) -> None:
    model = ["--dim", "128", "--n-layers", "4", "--seq-len", "128", "--batch-size", "16", "--max-iters", str(iters)]
    experts = ["--moe-experts", "8", "--moe-top-k", "2"]
    layouts = [("dense, FSDP", [], []), ("MoE, FSDP", experts, [])]
    layouts += [(f"MoE, ep {ep}", experts, ["--ep", str(ep)]) for ep in (2, 4) if ranks % ep == 0]
    rows, base = [], None
    for name, shape, mesh in layouts:
        s = run(ranks, [*model, *shape, *mesh, "--measure"], root / name.replace(", ", "-").replace(" ", ""))
        tps = s["stats"]["tps"]["mean"]
        base = base or tps
        rows.append((name, s, tps))
    print(
        f"\nmixture of experts vs dense, {ranks} ranks, Llama 128 wide x 4 blocks, batch 16 x 128; the MoE: 8 "
        f"experts, top-2, each half the dense width (same active parameters); {os.cpu_count()} cores\n"
    )
    head = "| layout | params | active | tokens/s | ratio to dense | dt s | peak host MiB | state MiB/rank |"
    print(head + " MiB moved on step 2 by group |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s, tps in rows:
        m = s["model"]
        active = s.get("experts", {}).get("active_params", m["num_params"])
        peak = max(r.get("peak_rss_bytes", 0) for r in s["memory_per_rank"])
        state = max(r["total_bytes"] for r in s["memory_per_rank"])
        print(
            f"| {name} | {m['num_params'] / 1e6:.2f} M | {active / 1e6:.2f} M | {tps:.0f} | {tps / base:.2f} | "
            f"{s['stats']['dt']['mean']:.4f} | {mib(peak)} | {mib(state)} | {groups(s)} |"
        )


def cp(root: Path, iters: int) -> None:
    model = ["--dim", "128", "--n-layers", "2", "--n-heads", "8", "--seq-len", "1024", "--batch-size", "2"]
    model += ["--max-iters", str(iters)]
    single = run(1, [*model, "--dp-shard", "1"], root / "cp1")["stats"]["dt"]["mean"]
    print(
        f"\ncontext parallel, ring vs all-to-all, global sequence 1024, batch 2; one process dt {single:.4f}s; "
        f"{os.cpu_count()} cores\n"
    )
    print("| cp | attention | dt s | ratio to one process | MiB moved on step 2 by group |")
    print("|---|---|---|---|---|")
    for n in (2, 4):
        for kind in ("ring", "ulysses"):
            s = run(
                n,
                [*model, "--cp", str(n), "--dp-shard", "1", "--cp-attention", kind, "--measure"],
                root / f"cp{n}-{kind}",
            )
            dt = s["stats"]["dt"]["mean"]
            print(f"| {n} | {kind} | {dt:.4f} | {dt / single:.2f} | {groups(s)} |")


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", choices=["moe", "cp", "both"], default="both")
    ap.add_argument("--iters", type=positive_int, default=8, help="steps of each run [8]")
    ap.add_argument("--ranks", type=positive_int, default=4, help="ranks of the experts' runs [4]")
    ap.add_argument("--outdir", type=Path, default=None, help="a new folder for the runs [a temporary one]")
    args = ap.parse_args()
    if args.outdir is not None and args.outdir.is_dir() and any(args.outdir.iterdir()):
        raise UsageError(f"--outdir {args.outdir} holds earlier runs: give a new one (each run needs its own folder)")
    root = args.outdir or Path(tempfile.mkdtemp(prefix="moe-cp-"))
    if args.what in ("moe", "both"):
        moe(root, args.iters, args.ranks)
    if args.what in ("cp", "both"):
        cp(root, args.iters)
    print(f"\nruns in {root}")


if __name__ == "__main__":
    run_command(main, "python benchmarks/moe_cp.py")
