"""Per-rank parameter + gradient + optimizer-state bytes of each data-parallel strategy, next to theory.

    .venv/bin/python benchmarks/zero_memory.py [--ranks 4] [--outdir /tmp/zero-mem] [-- extra vit flags]

Runs the ViT trainer once per strategy (ddp, fsdp, zero1, zero2, zero3) on --ranks CPU ranks,
reads the bytes each rank held right after the last backward (summary.json), and prints them
next to the ZeRO paper's figures for fp32 training with Adam, Psi parameters and N ranks:

    ddp    4 Psi params + 4 Psi grads + 8 Psi Adam moments           = 16 Psi
    fsdp   (4 + 4 + 8) Psi / N
    zero1  4 Psi + 4 Psi + 12 Psi / N   (moments + DeepSpeed's fp32 master partition)
    zero2  4 Psi + (4 + 12) Psi / N
    zero3  (4 + 4 + 12) Psi / N

(mmm.parallel.strategy.theoretical_state_bytes). The ratio column is measured / theory for
the total and for each part. DeepSpeed keeps full gradients only while backward runs: ZeRO-1
reduce-scatters them when backward ends (its after-backward gradients are a partition; its
peak, in the last column, is the full 4 Psi the theory counts), and ZeRO-2/3 reduce when a
bucket fills (reduce_bucket_size, 5e8 elements by default, so a small model's full gradient
is held until backward ends).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mmm.cli import positive_int
from mmm.errors import ArgumentParser, UsageError, run_command

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
MODEL = [
    "--depth",
    "4",
    "--num-heads",
    "8",
    "--head-dim",
    "32",
    "--img-size",
    "16",
    "--batch-size",
    "8",
    "--max-iters",
    "2",
    "--no-plots",
]


def main() -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=positive_int, default=4, help="ranks of each run [4]")
    ap.add_argument("--outdir", type=Path, default=None, help="a new folder for the runs [a temporary one]")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="more vit flags after --")
    args = ap.parse_args()
    earlier = [s for s in STRATEGIES if args.outdir is not None and (args.outdir / s).exists()]
    if earlier:  # each run would refuse its folder, after the others had run
        raise UsageError(f"--outdir {args.outdir} holds earlier runs ({', '.join(earlier)}): give a new one")
    root = args.outdir or Path(tempfile.mkdtemp(prefix="zero-mem-"))
    launch = str(Path(sys.executable).parent / "launch")
    extra = [a for a in args.extra if a != "--"]
    rows = []
    for strategy in STRATEGIES:
        out = root / strategy
        cmd = [
            launch,
            "-q",
            "-n",
            str(args.ranks),
            sys.executable,
            "-m",
            "mmm.examples.vit",
            *MODEL,
            *extra,
            "--strategy",
            strategy,
            "--outdir",
            str(out),
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{strategy}: FAILED\n{res.stderr[-2000:]}")
            continue
        s = json.loads((out / "summary.json").read_text())
        worst = max(s["memory_per_rank"], key=lambda m: m["total_bytes"])
        rows.append((strategy, s["model"]["num_params"], worst, s["state_bytes_theory"]))
    if not rows:
        print(f"zero_memory: every run failed (their outputs: {root})", file=sys.stderr)
        return 1
    print(
        f"\nper-rank state bytes, {args.ranks} ranks, fp32 + AdamW (Psi = {rows[0][1]:,} parameters); "
        "held right after the last backward, and the most gradient bytes held during it\n"
    )
    print(
        "| strategy | params (ratio) | grads (ratio) | optimizer (ratio) | total MiB | theory MiB | ratio "
        "| grads peak in backward MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for strategy, _, m, t in rows:
        cells = [f"{m[k] / 2**20:.3f} ({m[k] / t[k]:.2f})" for k in ("param_bytes", "grad_bytes", "optim_bytes")]
        peak = m.get("grad_peak_bytes")
        peak_cell = f"{peak / 2**20:.3f}" if peak else "-"
        print(
            f"| {strategy} | {' | '.join(cells)} | {m['total_bytes'] / 2**20:.3f} | "
            f"{t['total_bytes'] / 2**20:.3f} | {m['total_bytes'] / t['total_bytes']:.3f} | {peak_cell} |"
        )
    (root / "zero_memory.json").write_text(
        json.dumps([{"strategy": s, "num_params": psi, "measured": m, "theory": t} for s, psi, m, t in rows], indent=1)
    )
    print(f"\nraw figures: {root / 'zero_memory.json'}")
    return 0 if len(rows) == len(STRATEGIES) else 1


if __name__ == "__main__":
    run_command(main, "python benchmarks/zero_memory.py")
