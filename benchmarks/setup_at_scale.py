"""mmm's setup cost on one rank as the job grows: init_mesh + model on meta + parallelize, simulated.

    python benchmarks/setup_at_scale.py                      # worlds 64, 512, 4096, 16384
    python benchmarks/setup_at_scale.py --worlds 64,1024 --layouts fsdp

Each world is simulated in a fresh process (``python -m mmm.plan.simulate``: a fake process group of
that many ranks, the real mesh and composition, parameters left on meta) for Llama-3-8B's shape
(its published config.json: 32 layers, width 4096, 32/8 heads, FFN 14336, vocabulary 128256), rank 0
and the last rank. Layouts:
  * ``fsdp``: tp 8 x FSDP over every other rank (dp_shard = world / 8);
  * ``hsdp``: tp 8 x HSDP, FSDP within groups of 64 ranks (dp_shard 8), replicated across them;
  * ``pp``: pp 8 x tp 8 x FSDP (from 512 ranks up).
Prints, per layout and world, the last rank's seconds of mesh / parallelize (the first rank also
pays one-time imports), peak host memory, and each time's ratio to the smallest world's (the goal:
within 2x at 16,384 of 64), and beside them the same run with torch's ``fully_shard`` left as is
(``MMM_LEAN_FSDP_SETUP=0``; see ``mmm.parallel.fsdp_setup``). Materialising the shards is left
out: mmm initialises each parameter whole from its name and seed, then keeps its shard (see
docs/planning.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def layout_flags(layout: str, world: int) -> list[str] | None:
    if layout == "fsdp":
        return ["--tp", "8"]
    if layout == "hsdp":
        return ["--tp", "8", "--strategy", "hsdp", "--dp-replicate", str(world // 64)] if world >= 128 else None
    if layout == "pp":
        return ["--tp", "8", "--pp", "8", "--microbatches", "8"] if world >= 512 else None
    raise SystemExit(f"unknown layout {layout!r}: fsdp, hsdp or pp")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="64,512,4096,16384", help="world sizes simulated, comma-separated [%(default)s]")
    p.add_argument("--layouts", default="fsdp,hsdp,pp", help="layouts of each world, comma-separated [%(default)s]")
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run each world with torch's fully_shard as is (MMM_LEAN_FSDP_SETUP=0) [on]",
    )
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MMM_LOG_LEVEL": "WARNING"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmm-setup-") as tmp:
        model = Path(tmp) / "llama3-8b"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(LLAMA3_8B))
        for layout in args.layouts.split(","):
            for world in worlds:
                flags = layout_flags(layout, world)
                if flags is None:
                    continue
                out = Path(tmp) / f"{layout}-{world}.json"
                batch = str(world)  # a sequence per rank: divisible by any dp
                cmd = [
                    sys.executable,
                    "-m",
                    "mmm.plan.simulate",
                    "--world",
                    str(world),
                    "--no-step",
                    "--json",
                    str(out),
                ]
                cmd += ["--init-from", str(model), "--seq-len", "8192", "--batch-size", batch, *flags]
                runs = {}
                for lean in ("1", "0") if args.compare else ("1",):
                    env["MMM_LEAN_FSDP_SETUP"] = lean
                    res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                    if res.returncode != 0:
                        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
                    runs[lean] = json.loads(out.read_text())[-1]
                last = runs["1"]
                rows.append((layout, world, last, runs.get("0")))
                s = last["setup_s"]
                print(
                    f"  {layout} {world}: mesh {s['mesh']:.3f}s parallelize {s['parallelize']:.2f}s "
                    f"peak {last['peak_rss_bytes'] / 2**20:.0f} MiB",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"\nsetup on one simulated rank (the last), Llama-3-8B shape on meta, {os.cpu_count()} cores\n")
    print("| layout | world | mesh s | parallelize s | both s | x smallest | peak host MiB | state MiB/rank |", end="")
    print(" torch's own fully_shard: both s | x smallest | peak host MiB |" if args.compare else "")
    print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if args.compare else ""))
    base: dict[str, float] = {}
    for layout, world, r, plain in rows:
        s = r["setup_s"]
        total = s["mesh"] + s["parallelize"]
        base.setdefault(layout, total)
        print(
            f"| {layout} | {world} | {s['mesh']:.3f} | {s['parallelize']:.2f} | {total:.2f} | "
            f"{total / base[layout]:.1f}x | {r['peak_rss_bytes'] / 2**20:.0f} | {r['total_bytes'] / 2**20:.1f} |",
            end="",
        )
        if plain is None:
            print()
            continue
        p = plain["setup_s"]["mesh"] + plain["setup_s"]["parallelize"]
        base.setdefault(layout + " as is", p)
        print(f" {p:.2f} | {p / base[layout + ' as is']:.1f}x | {plain['peak_rss_bytes'] / 2**20:.0f} |")


if __name__ == "__main__":
    main()
