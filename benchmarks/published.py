"""The planner on published runs: what it predicts for torchtitan's and Megatron's measured Llama 3 layouts.

    python benchmarks/published.py [--rows 8b-8,70b-256] [--out published.json]

For each row of torchtitan's docs/performance.md (commit eaea6f6, runs of 2024-12: H100 96 GB HBM2e
at 500 W, 8 per host, 400 Gb/s per GPU between hosts) this simulates the same model shape, layout,
batch, sequence length and activation checkpointing with ``python -m mmm.plan.simulate --hardware
h100`` (bf16, eager) and prints the predicted tokens/s per GPU and peak memory beside the published
ones. The models are given as Hugging Face ``config.json`` files written here (the public shapes of
Llama 3.1 8B, 70B and 405B; the 3.1 rope scaling is left out: it changes no shape, FLOP or byte).
A sanity check, not a proof: torchtitan's 70B and 405B rows also use torch.compile, Float8 matmuls
and async TP, which the prediction does not model.
One row is Megatron Bridge's (its DGX-H100 Llama 3 8B run, FP8 with Transformer Engine's kernels), two
the Llama 3 paper's 405B pretraining on 16,384 H100s (Meta's own stack, bf16, 400 TFLOP/s per GPU), with
1F1B and with an interleaved schedule as the paper's. Rows with a pipeline are simulated by blocks
(``--pick`` with every degree given: one layout, each stage at three and four blocks, carried on to its
count; stages of four blocks or fewer whole), a minute or two each; the others whole.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmm.errors import ArgumentParser, run_command
from mmm.plan.hardware import load_hardware

SHAPES = {  # hidden, layers, heads, kv heads, intermediate (vocabulary 128,256 for all)
    "8b": (4096, 32, 32, 8, 14336),
    "70b": (8192, 80, 64, 8, 28672),
    "405b": (16384, 126, 128, 8, 53248),
}

# (row, model, world, trainer flags, published TPS/GPU, published memory GiB, what else the run had); a
# pipeline row gives every degree (--pick then simulates its one layout by blocks)
ROWS = [
    ("8b-8", "8b", 8, ["--batch-size", "16", "--ac", "selective"], 5762, 82.4, "eager"),
    ("8b-128", "8b", 128, ["--batch-size", "256", "--ac", "selective"], 5605, 67.0, "eager"),
    ("70b-256", "70b", 256, ["--tp", "8", "--batch-size", "512", "--ac", "full"], 829, 71.9, "compile + Float8"),
    # Megatron Bridge's DGX-H100 rows (docs/performance-summary-archive.md, 25.11 container; FP8 current
    # scaling, Transformer Engine). Its 8B run accumulates 16 microbatches of one sequence per rank, as
    # here (--microbatches without a pipeline); its memory is not published
    (
        "8b-8-mcore",
        "8b",
        8,
        ["--batch-size", "128", "--microbatches", "16", "--ac", "none"],
        14451,
        None,
        "Megatron: FP8 + TE, 16 accumulated",
    ),
    (
        "405b-512",
        "405b",
        512,
        ["--pp", "8", "--tp", "8", "--dp-shard", "8", "--batch-size", "256", "--microbatches", "32", "--ac", "full"]
        + ["--split-points", "16,32,48,64,80,96,112"],  # 126 blocks: 7 stages of 16, the last of 14
        100,
        82.5,
        "compile + Float8 + async TP, 1F1B",
    ),
    # the Llama 3 paper (arXiv 2407.21783, its table 4): 16,384 H100s, TP 8 x PP 16 x DP 128, 8,192-token
    # sequences, 16M tokens a step, bf16, 400 TFLOP/s per GPU; its first and last stages hold one block
    # less (7, 14 x 8, 7); its schedule is an interleaved one of its own (1F1B here: the bubble differs)
    (
        "405b-16k",
        "405b",
        16384,
        ["--pp", "16", "--tp", "8", "--dp-shard", "128", "--batch-size", "2048", "--microbatches", "16"]
        + ["--ac", "full", "--split-points", ",".join(str(7 + 8 * i) for i in range(15))],
        None,
        None,
        "Meta's stack, bf16, its interleaved schedule",
    ),
    # the same with an interleaved schedule: 2 stages per rank, 32 of 4 blocks but the first and last (3);
    # stages of 4 blocks or fewer are simulated whole
    (
        "405b-16k-il",
        "405b",
        16384,
        ["--pp", "16", "--tp", "8", "--dp-shard", "128", "--batch-size", "2048", "--microbatches", "16"]
        + ["--ac", "full", "--stages-per-rank", "2", "--pp-schedule", "interleaved-1f1b"]
        + ["--split-points", ",".join(str(3 + 4 * i) for i in range(31))],
        None,
        None,
        "Meta's stack, bf16; interleaved 1F1B here",
    ),
]
# runs published as model TFLOP/s per GPU rather than tokens/s
PUBLISHED_TFLOPS = {"405b-16k": 400, "405b-16k-il": 400}


def write_config(root: Path, name: str) -> Path:
    hidden, layers, heads, kv, ffn = SHAPES[name]
    folder = root / f"llama-3.1-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": ffn,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def row_names(text: str) -> list[str]:
    """Names of rows of ROWS, comma-separated; an unknown one is refused."""
    names = [s.strip() for s in text.split(",")]
    valid = [r[0] for r in ROWS]
    unknown = list(dict.fromkeys(n for n in names if n not in valid))
    if unknown:
        many = "s" if len(unknown) > 1 else ""
        raise argparse.ArgumentTypeError(
            f"unknown row{many} {', '.join(map(repr, unknown))}; choose from {', '.join(valid)}"
        )
    return names


def main() -> int:
    ap = ArgumentParser(prog="python benchmarks/published.py", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows",
        type=row_names,
        default=None,
        metavar="ROW,ROW",
        help="comma-separated subset of " + ",".join(r[0] for r in ROWS) + " [all]",
    )
    ap.add_argument("--hardware", default="h100", help="the planner's preset or file [h100]")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    ns = ap.parse_args()
    rows = [r for r in ROWS if ns.rows is None or r[0] in ns.rows]
    peak = load_hardware(ns.hardware).peak("bf16")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, world, flags, tps, mem, extra in rows:
            folder = write_config(Path(tmp), model)
            sim = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, "-m", "mmm.plan.simulate", "--world", str(world), "--hardware", ns.hardware]
            cmd += ["--init-from", str(folder), "--seq-len", "8192", "--dtype", "bf16", *flags, "--json", str(sim)]
            piped = "--pp" in flags
            if piped:  # every degree given: the pick's one layout, simulated by blocks
                cmd += ["--pick", "--dp-replicate", "1", "--cp", "1", "--strategy", "fsdp"]
            t0 = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if res.returncode:
                print(res.stdout[-2000:], res.stderr[-3000:], sep="\n", file=sys.stderr)
                return 1
            ranks = json.loads(sim.read_text())
            if piped:
                (layout,) = ranks
                ranks = layout["ranks"]
            batch = int(flags[flags.index("--batch-size") + 1])
            step = max(r["prediction"]["step_s"] for r in ranks)
            mfu = min(r["prediction"]["mfu"] for r in ranks)
            row = {
                "row": name,
                "world": world,
                "flags": flags,
                "published_tps_per_gpu": tps,
                "published_tflops_per_gpu": PUBLISHED_TFLOPS.get(name),
                "published_memory_gib": mem,
                "published_with": extra,
                "predicted_step_s": step,
                "predicted_tps_per_gpu": batch * 8192 / world / step,
                "predicted_peak_gib": max(r["prediction"]["peak_bytes"] for r in ranks) / 2**30,
                "predicted_mfu": mfu,
                "predicted_tflops_per_gpu": mfu * peak / 1e12,
                "simulated_s": seconds,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n{'run':<10}{'GPUs':>6}  {'published':>18}{'predicted':>11}{'ratio':>7}"
        f"  {'GiB published':>14}{'predicted':>11}  {'MFU pred':>9}  published with"
    )
    for r in results:
        if r["published_tps_per_gpu"]:  # tokens/s per GPU, or else model TFLOP/s per GPU
            pub, pred, unit = r["published_tps_per_gpu"], r["predicted_tps_per_gpu"], "TPS/GPU"
        else:
            pub, pred, unit = r["published_tflops_per_gpu"], r["predicted_tflops_per_gpu"], "TFLOP/s"
        print(
            f"{r['row']:<10}{r['world']:>6}  {f'{pub:,} {unit}':>18}{pred:>11,.0f}{pred / pub:>7.2f}  "
            f"{'-' if r['published_memory_gib'] is None else format(r['published_memory_gib'], '.1f'):>14}"
            f"{r['predicted_peak_gib']:>11.1f}  {r['predicted_mfu']:>9.1%}  {r['published_with']}"
        )
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_command(main, "python benchmarks/published.py")
