"""Train a Llama-style model with tensor/sequence parallel + FSDP2 (or HSDP, or DDP) on a (dp, tp) mesh.

    launch -n 4 python3 -m mmm.examples.fsdp_tp --tpsize 2          # dp=2 x tp=2 on CPU ranks
    launch python3 -m mmm.examples.fsdp_tp --tp 4 --dim 2048 ...     # a GPU allocation, same flags

--batch-size is the GLOBAL batch (sequences per optimizer step), split evenly over dp ranks;
with the same --seed and global batch the per-step losses are the same on any mesh.
Writes history.jsonl (live), history.nc, summary.json and plots/ to --outdir.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mmm.cli import (ArgumentParser, add_mesh_args, add_output_args, add_run_args, add_strategy_args, positive_int,
                     run_arg_problems)
from mmm.errors import UsageError
from mmm.flops import llama_flops_per_token
from mmm.training import torchinfo_summary

EXAMPLE = "fsdp_tp"
MEASURE_STEP = 2  # --measure watches this step (a warmup step with the default --warmup 2)


def build_parser() -> ArgumentParser:
    from mmm.data import DATASETS
    from mmm.parallel.activation_checkpoint import AC_MODES
    from mmm.parallel.pipeline import SCHEDULES

    p = ArgumentParser(prog=f"python -m mmm.examples.{EXAMPLE}", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 2)[2])
    add_mesh_args(p)
    g = add_strategy_args(p, dp_replicate=False)  # --dp-replicate is a mesh flag here
    g.add_argument("--reshard-after-forward", choices=["auto", "true", "false"], default="auto",
                   help="FSDP: free gathered parameters after forward (true: less memory, one more all-gather "
                        "in backward); auto: every block but the root [auto]")
    g = p.add_argument_group("pipeline parallel (with --pp > 1)")
    g.add_argument("--pp-schedule", "--pp_schedule", dest="pp_schedule", choices=list(SCHEDULES), default="1f1b",
                   help="pipelining schedule; interleaved ones need --stages-per-rank >= 2 [1f1b]")
    g.add_argument("--microbatches", type=positive_int, default=None,
                   help="microbatches per step, dividing the per-dp-rank batch [pp]")
    g.add_argument("--stages-per-rank", "--stages_per_rank", dest="stages_per_rank", type=positive_int, default=1,
                   help="pipeline stages each rank holds (looped placement) [1]")
    g.add_argument("--split-points", "--split_points", dest="split_points", type=_int_list, default=None,
                   metavar="I,J,...", help="first block of each stage after the first [even split]")
    g = p.add_argument_group("model (Llama-style)")
    g.add_argument("--dim", type=positive_int, default=256, help="model width [256]")
    g.add_argument("--n-layers", "--n_layers", dest="n_layers", type=positive_int, default=4,
                   help="transformer blocks [4]")
    g.add_argument("--n-heads", "--n_heads", dest="n_heads", type=positive_int, default=8,
                   help="attention heads (divisible by tp) [8]")
    g.add_argument("--n-kv-heads", "--n_kv_heads", dest="n_kv_heads", type=positive_int, default=None,
                   help="key/value heads for grouped-query attention [= n-heads]")
    g.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=positive_int, default=256,
                   help="vocabulary; 256 for byte-level data [256]")
    g.add_argument("--seq-len", "--seq_len", dest="seq_len", type=positive_int, default=128,
                   help="tokens per sequence [128]")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", "--batch_size", dest="batch_size", type=positive_int, default=16,
                   help="GLOBAL batch in sequences per step, divisible by dp [16]")
    g.add_argument("--max-iters", "--max_iters", dest="max_iters", type=positive_int, default=40,
                   help="optimizer steps [40]")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate [3e-3]")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay [0]")
    g.add_argument("--grad-clip", "--grad_clip", dest="grad_clip", type=float, default=0.0,
                   help="clip the global gradient L2 norm (over all shards and pipeline stages); 0 = off [0]")
    g.add_argument("--seed", type=int, default=0, help="seed of weights and data [0]")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="compute dtype; bf16 keeps fp32 master weights and fp32 gradient reduction [fp32]")
    g.add_argument("--compile", action="store_true", help="torch.compile each block")
    g.add_argument("--ac", choices=AC_MODES, default="none",
                   help="activation checkpointing: full block, or selective (keep matmul outputs) [none]")
    g.add_argument("--dataset", choices=DATASETS, default="synthetic",
                   help="synthetic (learnable sequences) or pydoc (byte-level English text shipped with "
                        "Python) [synthetic]")
    g.add_argument("--measure", action="store_true",
                   help="on step 2 (a warmup step) count the bytes each mesh process group communicates and "
                        "the bytes of activations saved for backward, per rank, into summary.json "
                        "(measured_per_rank); that step runs slower")
    add_output_args(p, EXAMPLE)
    add_run_args(p)
    return p


def _int_list(text: str) -> list[int]:
    import argparse

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def arg_problems(args, world_size: int) -> list[str]:
    """Every problem with the flags for this world size (the planner asks this of each combination)."""
    from mmm.data import dataset_problems
    from mmm.parallel import ParallelDims, check_degrees
    from mmm.parallel.context import cp_problems
    from mmm.parallel.pipeline import pipeline_problems
    from mmm.parallel.compose import compile_problems
    from mmm.parallel.strategy import strategy_problems
    from mmm.training import batch_problems
    from mmm.parallel.tensor import tp_problems

    degrees = {a: getattr(args, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    _, problems = check_degrees(world_size, **degrees)
    mesh_ok = not problems
    cfg = model_config(args)
    problems += cfg.problems()
    if mesh_ok:
        dims = ParallelDims(world_size=world_size, **degrees)
        problems += cp_problems(cp=dims.cp, seq_len=cfg.seq_len, tp=dims.tp)
        if args.batch_size % dims.dp == 0:
            problems += pipeline_problems(pp=dims.pp, n_layers=cfg.n_layers, schedule=args.pp_schedule,
                                          stages_per_rank=args.stages_per_rank,
                                          microbatches=args.microbatches or dims.pp,
                                          local_batch=args.batch_size // dims.dp, split_points=args.split_points)
        problems += strategy_problems(args.strategy, dims, offload_optimizer=args.offload_optimizer)
        problems += compile_problems(args.compile, dims)
        problems += tp_problems(tp=dims.tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                                vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
        problems += batch_problems(args.batch_size, dims.dp)
    problems += dataset_problems(args.dataset, vocab_size=args.vocab_size)
    if args.grad_clip < 0:
        problems.append(f"--grad-clip {args.grad_clip} must be >= 0 (0 turns clipping off)")
    problems += run_arg_problems(args)
    if args.measure and args.max_iters < MEASURE_STEP:
        problems.append(f"--measure watches step {MEASURE_STEP}; --max-iters {args.max_iters} is too few "
                        f"(use --max-iters {MEASURE_STEP} or more)")
    return problems


def check_args(args, world_size: int) -> None:
    """Every problem with the flags for this world size, at once, as one UsageError."""
    problems = arg_problems(args, world_size)
    if problems:
        raise UsageError("; ".join(problems))


def _reshard(args) -> bool | None:
    return {"auto": None, "true": True, "false": False}[args.reshard_after_forward]


def checkpoint_meta(args, cfg, mesh) -> dict:
    """What a checkpoint records about the run; ``model`` must match to resume."""
    return {"example": EXAMPLE, "model": dict(vars(cfg)), "mesh": mesh.dims.degrees, "strategy": args.strategy,
            "seed": args.seed, "global_batch": args.batch_size, "dataset": args.dataset}


def _loop_setup(args, info, outdir, startup, engine, cfg, mesh, dataset, log):
    """What both training loops start from: the checkpointer, the first step (after ``--resume``),
    this dp rank's batches from that step on, and the Run that records the steps."""
    from mmm.data import local_batches
    from mmm.training import Run, make_checkpointer, resume

    ckpt = make_checkpointer(args, engine, meta=checkpoint_meta(args, cfg, mesh), log=log)
    start = resume(args, ckpt, startup)
    batches = local_batches(dataset, seed=args.seed, global_batch=args.batch_size, dp_rank=mesh.coord("dp"),
                            dp_size=mesh.dp, start_step=start - 1, device=info.device)
    run = Run(EXAMPLE, info=info, outdir=outdir, startup=startup, warmup=args.warmup, log_every=args.log_every,
              resume_step=start - 1)
    return ckpt, start, batches, run


def model_config(args):
    from mmm.models.llama import LlamaConfig

    return LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
                       vocab_size=args.vocab_size, seq_len=args.seq_len)


def main(argv: Sequence[str] | None = None) -> int:
    from mmm.training import Startup

    startup = Startup()
    args = build_parser().parse_args(argv)
    from mmm import dist

    info = dist.setup(seed=args.seed, timeout=args.timeout)
    startup.mark_setup(info)
    if info.is_main:
        from mmm.log import get_logger

        get_logger().info("%s", dist.banner(info))
    check_args(args, info.world_size)
    from mmm.training import resolve_outdir

    outdir = resolve_outdir(args.outdir, EXAMPLE)
    return train(args, info, outdir, startup)


def train(args, info, outdir, startup) -> int:
    import torch
    import torch.nn.functional as F

    from mmm import dist
    from mmm.data import make_dataset
    from mmm.log import get_logger
    from mmm.models.llama import Llama
    from mmm.parallel import ParallelSpec, describe_sharding, init_mesh
    from mmm.parallel.context import apply_cp_llama, shard_sequence
    from mmm.parallel.strategy import build_engine
    from mmm.parallel.tensor import llama_tp_plan, loss_parallel_context
    from mmm.training import compiled_graphs, mean_over, train_step

    log = get_logger()
    # 1. the mesh: pp x dp_replicate x dp_shard x cp x tp
    mesh = init_mesh(tp=args.tp, pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard)
    startup.mark("mesh")

    # 2. the model: plain single-device code, the same weights on every rank
    cfg = model_config(args)
    dataset = make_dataset(args.dataset, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    torch.manual_seed(args.seed)
    model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("model: %s", cfg)
        log.info("%s", torchinfo_summary(model))
    model.to(info.device)
    startup.mark("model")

    # 3. parallelise: context parallel swaps in ring attention; then TP -> AC -> compile -> FSDP,
    #    for the whole model or for each pipeline stage
    if mesh.cp_enabled:
        apply_cp_llama(model, mesh["cp"], seq_len=cfg.seq_len)
    spec = ParallelSpec(tp_plan=llama_tp_plan(), loss_parallel=True, blocks="layers", ac=args.ac,
                        compile=args.compile, dtype=args.dtype, reshard_after_forward=_reshard(args))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    engine = build_engine(
        model, mesh, spec, strategy=args.strategy, device=info.device, max_grad_norm=args.grad_clip,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay),
        global_batch=args.batch_size, optimizer_args={"lr": args.lr, "weight_decay": args.weight_decay},
        offload_optimizer=args.offload_optimizer,
        pipeline_args=dict(loss_fn=loss_fn, microbatches=args.microbatches, schedule=args.pp_schedule,
                           stages_per_rank=args.stages_per_rank, split_points=args.split_points))
    del model
    if info.is_main:
        if engine.pipeline is not None:
            log.info("%s", engine.pipeline.describe())
        else:
            log.info("model after parallelisation (%s, %s):\n%s", args.strategy, mesh.dims, engine.module)
        log.info("%s", describe_sharding(engine.module))
    startup.mark("parallelize")

    # 4. the loop: each dp rank takes its slice of the global batch; cp ranks their sequence shards
    ckpt, start, batches, run = _loop_setup(args, info, outdir, startup, engine, cfg, mesh, dataset, log)
    tokens_per_step = args.batch_size * cfg.seq_len
    if info.is_main:
        if mesh.cp_enabled:
            log.info("context parallel: ring attention over %d ranks, %d tokens each (chunks r and 2cp-1-r of %d)",
                     mesh.cp, cfg.seq_len // mesh.cp, 2 * mesh.cp)
        log.info("training steps %d-%d: global batch %d x %d tokens (%d per dp rank), dataset=%s, dtype=%s, out=%s",
                 start, args.max_iters, args.batch_size, cfg.seq_len, args.batch_size // mesh.dp, dataset.name,
                 args.dtype, outdir)
    dist.graceful_sigterm()
    engine.train()
    for step in range(start, args.max_iters + 1):
        poison = run.begin_step(step)
        t0 = time.perf_counter()
        inputs, labels = next(batches)
        if mesh.cp_enabled:
            cp_rank = mesh.coord("cp")
            inputs, labels = shard_sequence(inputs, cp_rank, mesh.cp), shard_sequence(labels, cp_rank, mesh.cp)
        last = step == args.max_iters
        with run.measuring(mesh, enabled=args.measure and step == MEASURE_STEP):
            loss, times = train_step(engine, inputs, labels, loss_fn, device=info.device, t_start=t0,
                                     context=loss_parallel_context(mesh.tp_enabled), poison=poison,
                                     skip_nonfinite=args.on_nonfinite == "skip",
                                     after_backward=(lambda: run.capture_memory(engine)) if last else None)
            loss_value = mean_over(loss, mesh.group("dp_cp"))  # TP and PP peers already hold the same loss
        run.record(step, force_log=last, loss=loss_value, **times, tps=tokens_per_step / times["dt"],
                   grad_norm=engine.grad_norm)
        if run.end_step(step, loss_value, args=args, checkpointer=ckpt, last=last, skipped=bool(times.get("skipped"))):
            break

    extra = {
        "mesh": mesh.dims.degrees, "strategy": args.strategy, "dtype": args.dtype, "ac": args.ac,
        "compile": args.compile, "compiled_graphs": compiled_graphs(),
        "reshard_after_forward": args.reshard_after_forward, "dataset": dataset.name,
        "model": {**vars(cfg), "num_params": n_params}, "global_batch": args.batch_size,
        "tokens_per_step": tokens_per_step,
    }
    if engine.pipeline is not None:
        pipe = engine.pipeline
        extra["pipeline"] = {"schedule": pipe.schedule_name, "microbatches": pipe.microbatches,
                             "stages": pipe.num_stages, "stages_per_rank": len(pipe.stage_ids),
                             "layer_ranges": pipe.layer_ranges}
    run.finish(engine, extra, mesh=mesh, num_params=n_params, plots=not args.no_plots,
               flops_per_unit=llama_flops_per_token(cfg), dtype=args.dtype)
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
