"""Per-rank peak memory of FSDP on a model larger than one rank should hold: after setup, after step 1.

    .venv/bin/python benchmarks/memory.py [--ranks 8] [--dim 1024 --n-layers 48] [--outdir DIR]

Runs the fsdp_tp trainer (FSDP over every rank, fp32, AdamW, one step) twice under ``launch``:
a tiny Llama (the baseline: interpreter, torch, gloo, buffers) and a big one (default ~608M
parameters: 2.4 GB of fp32 weights). Each rank's ``summary.json`` entry ``memory.after_setup`` /
``memory.after_first_step`` holds its peak resident memory (peak device memory on cuda/xpu) at
those moments. The table prints, per rank, the peak's growth over the tiny run next to

    whole model     4 Psi bytes (fp32 weights: what every rank held before meta-device construction, 3.5x over)
    ideal FSDP      16 Psi / N  (params + grads + two AdamW moments, sharded over N ranks) = 0.5x at N = 8

and the ratio growth / whole model. The model is built on ``meta``; each rank materialises only
its shards, one full parameter at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mmm.cli import positive_int
from mmm.errors import ArgumentParser, UsageError, run_command

COMMON = [
    "--strategy",
    "fsdp",
    "--max-iters",
    "1",
    "--warmup",
    "0",
    "--no-plots",
    "--seq-len",
    "16",
    "--vocab-size",
    "256",
]
TINY = ["--dim", "64", "--n-layers", "2", "--n-heads", "4"]


def run(launch: str, ranks: int, flags: list[str], out: Path) -> dict:
    cmd = [
        launch,
        "-q",
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mmm.examples.fsdp_tp",
        *COMMON,
        *flags,
        "--outdir",
        str(out),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "MMM_RICH": "0"}
    )
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def peak(mark: dict) -> int:
    return mark.get("peak_allocated_bytes", mark["peak_rss_bytes"])


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=positive_int, default=8, help="FSDP ranks [8]")
    ap.add_argument("--dim", type=positive_int, default=1024, help="the large model's width [1024]")
    ap.add_argument("--n-layers", type=positive_int, default=48, help="its blocks [48]")
    ap.add_argument("--n-heads", type=positive_int, default=16, help="its attention heads [16]")
    ap.add_argument("--outdir", type=Path, default=None, help="a new folder for the two runs [a temporary one]")
    args = ap.parse_args()
    earlier = [n for n in ("tiny", "big") if args.outdir is not None and (args.outdir / n).exists()]
    if earlier:  # the runs would refuse their folders, one after the other
        raise UsageError(f"--outdir {args.outdir} holds earlier runs ({', '.join(earlier)}): give a new one")
    root = args.outdir or Path(tempfile.mkdtemp(prefix="memory-"))
    launch = str(Path(sys.executable).parent / "launch")
    batch = ["--batch-size", str(args.ranks)]
    tiny = run(launch, args.ranks, TINY + batch, root / "tiny")
    big = run(
        launch,
        args.ranks,
        ["--dim", str(args.dim), "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads)] + batch,
        root / "big",
    )
    psi = big["model"]["num_params"]
    whole, ideal = 4 * psi, 16 * psi / args.ranks
    print(
        f"\nFSDP over {args.ranks} ranks, fp32 + AdamW, one step; model {psi / 1e6:.0f}M parameters = "
        f"{whole / 2**30:.2f} GiB of fp32 weights (dim {args.dim}, {args.n_layers} layers); "
        f"ideal sharded state {ideal / 2**30:.2f} GiB/rank ({ideal / whole:.3g}x the weights at {args.ranks} ranks)\n"
    )
    print("| rank | tiny peak GiB | after setup GiB (+growth) | after step 1 GiB (+growth) | growth / whole model |")
    print("|---:|---:|---:|---:|---:|")
    worst = 0.0
    for r in range(args.ranks):
        base = peak(tiny["memory"]["after_first_step"][r])
        setup = peak(big["memory"]["after_setup"][r])
        step = peak(big["memory"]["after_first_step"][r])
        worst = max(worst, (step - base) / whole)
        print(
            f"| {r} | {base / 2**30:.2f} | {setup / 2**30:.2f} ({(setup - base) / 2**30:+.2f}) | "
            f"{step / 2**30:.2f} ({(step - base) / 2**30:+.2f}) | {(step - base) / whole:.3f}x |"
        )
    print(
        f"\nworst rank: peak grows {worst:.3f}x of the whole model's fp32 weights "
        f"(ideal {ideal / whole:.3f}x; before meta-device construction: 3.5x)"
    )
    (root / "memory.json").write_text(
        json.dumps(
            {
                "ranks": args.ranks,
                "num_params": psi,
                "whole_bytes": whole,
                "ideal_bytes": ideal,
                "worst_growth_ratio": worst,
                "tiny": tiny["memory"],
                "big": big["memory"],
            },
            indent=1,
        )
    )
    print(f"data: {root / 'memory.json'}")


if __name__ == "__main__":
    run_command(main, "python benchmarks/memory.py")
