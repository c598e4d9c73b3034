"""float8 against bf16 on real text: the same run twice, the loss curves side by side.

    python benchmarks/float8_curve.py --out float8_curve.json       # on an H100-class device, about 3 minutes

Runs the fsdp_tp trainer on ``--dataset pydoc`` (CPython's own reference text, byte-level: no download)
with the yardstick's shape (dim 2,048, 16 layers, 16 heads, sequences of 2,048, batch 8), the same seed
and batches, once with ``--a``'s flags (bf16, compiled) and once with ``--b``'s (the same with
``--float8``), and compares the per-step losses: the largest gap over the run, the mean gap over the
last quarter of the steps (relative to bf16's loss there), and each run's step time. float8 passes when
that late mean gap is within ``--tolerance`` (2% by default: tensorwise float8's rounding shows in the
loss, a silently broken conversion or scaling shows far more). ``--b`` without ``--float8`` (on a CPU,
``--a "--dtype bf16" --b "--dtype bf16"``) checks the script itself: the gap is then 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mmm.errors import UsageError, run_command

MODEL = "--dim 2048 --n-layers 16 --n-heads 16 --seq-len 2048 --batch-size 8"


def run(name: str, flags: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "mmm.examples.fsdp_tp", *flags, "--outdir", str(out), "--no-plots"]
    print(f"float8_curve: run {name}: {' '.join(flags)}", flush=True)
    p = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True)
    if p.returncode:
        print(p.stdout[-2000:], p.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{name} failed ({p.returncode}): {' '.join(cmd)}")
    rows = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text())
    return {"loss": [r["loss"] for r in rows], "step_s": summary["stats"]["dt"]["mean"], "mfu": summary.get("mfu")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="steps per run [120]")
    ap.add_argument("--model", default=MODEL, help=f"the model's flags [{MODEL}]")
    ap.add_argument("--a", default="--dtype bf16 --compile", help="the reference run's flags [--dtype bf16 --compile]")
    ap.add_argument(
        "--b",
        default="--dtype bf16 --compile --float8",
        help="the compared run's flags [--dtype bf16 --compile --float8]",
    )
    ap.add_argument("--tolerance", type=float, default=0.02, help="late mean gap allowed, relative [0.02]")
    ap.add_argument("--out", default=None, help="also write the result as JSON")
    ns = ap.parse_args()
    if "--float8" in (ns.a + " " + ns.b).split():
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                "--float8 trains on an H100-class CUDA device and there is none here: check the script on a CPU "
                'with a small --model and --a "--dtype bf16" --b "--dtype bf16" (the gap is then 0)'
            )
    common = [*ns.model.split(), "--dataset", "pydoc", "--max-iters", str(ns.steps), "--seed", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        a = run("a", [*common, *ns.a.split()], Path(tmp) / "a")
        b = run("b", [*common, *ns.b.split()], Path(tmp) / "b")
    gaps = [y - x for x, y in zip(a["loss"], b["loss"], strict=True)]
    late = slice(len(gaps) * 3 // 4, None)
    late_a = sum(a["loss"][late]) / len(a["loss"][late])
    late_gap = sum(gaps[late]) / len(gaps[late])
    result = {
        "a": ns.a,
        "b": ns.b,
        "steps": len(gaps),
        "first_loss": [a["loss"][0], b["loss"][0]],
        "last_loss": [a["loss"][-1], b["loss"][-1]],
        "max_abs_gap": max(abs(g) for g in gaps),
        "late_mean_gap": late_gap,
        "late_mean_gap_rel": late_gap / late_a,
        "step_s": [a["step_s"], b["step_s"]],
        "speedup": a["step_s"] / b["step_s"],
        "mfu": [a["mfu"], b["mfu"]],
        "tolerance": ns.tolerance,
        "within_tolerance": abs(late_gap / late_a) <= ns.tolerance,
        "loss_a": a["loss"],
        "loss_b": b["loss"],
    }
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("loss_")}))
    print(
        f"{ns.b!r} vs {ns.a!r} over {len(gaps)} steps: loss {a['loss'][-1]:.4f} vs {b['loss'][-1]:.4f} at the end, "
        f"late mean gap {late_gap:+.4f} ({late_gap / late_a:+.2%}; tolerance {ns.tolerance:.0%}), "
        f"step {b['step_s'] * 1e3:.1f} vs {a['step_s'] * 1e3:.1f} ms ({result['speedup']:.2f}x)"
    )
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["within_tolerance"] else 1


if __name__ == "__main__":
    run_command(main, "python benchmarks/float8_curve.py")
