"""Train a Llama-style model with tensor/sequence parallel + FSDP2 (or HSDP, or DDP) on a (dp, tp) mesh.

    launch -n 4 python3 -m mmm.examples.fsdp_tp --tpsize 2          # dp=2 x tp=2 on CPU ranks
    launch python3 -m mmm.examples.fsdp_tp --tp 4 --dim 2048 ...     # a GPU allocation, same flags

--batch-size is the GLOBAL batch (sequences per optimizer step), split evenly over dp ranks;
with the same --seed and global batch the per-step losses are the same on any mesh.
Writes history.jsonl (live), history.nc, summary.json and plots/ to --outdir.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmm.flops import llama_flops_per_token
from mmm.training import llama as flags
from mmm.training import torchinfo_summary
from mmm.training.llama import MEASURE_STEP, check_args, loop_setup, model_config, pp_schedule, reshard_after_forward

EXAMPLE = "fsdp_tp"


def build_parser():
    return flags.build_parser(__doc__)


def main(argv: Sequence[str] | None = None) -> int:
    from mmm.training import start

    args, info, outdir, startup = start(EXAMPLE, build_parser(), argv, check_args)
    return train(args, info, outdir, startup)


def train(args, info, outdir, startup) -> int:
    import time

    import torch
    import torch.nn.functional as F

    from mmm import dist
    from mmm.data import make_dataset
    from mmm.log import get_logger
    from mmm.models.llama import Llama
    from mmm.parallel import ParallelSpec, describe_sharding, init_mesh, meta_init
    from mmm.parallel.context import apply_cp_llama, shard_sequence
    from mmm.parallel.strategy import build_engine
    from mmm.parallel.tensor import llama_tp_plan, loss_parallel_context
    from mmm.training import compiled_graphs, train_step
    from mmm.training.evaluation import eval_due, perplexity
    from mmm.training.schedule import schedule_from_args, set_lr
    from mmm.training.step import evaluate

    log = get_logger()
    # 1. the mesh: pp x dp_replicate x dp_shard x cp x tp
    mesh = init_mesh(tp=args.tp, pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard)
    startup.mark("mesh")

    # 2. the model: plain single-device code, built on `meta` (no memory yet); each rank materialises
    #    only its own shards after step 3, every weight seeded by --seed and its name (any mesh, same weights)
    cfg = model_config(args)
    dataset = make_dataset(args.dataset, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, **flags.data_options(args))
    if info.device.type == "cpu":  # a large model in host memory: freed tensors go back at once (decided early)
        dist.return_freed_host_memory(4 * cfg.num_params())
    with meta_init():
        model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("model: %s", cfg)
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(args.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")

    # 3. parallelise: context parallel swaps in ring attention; then TP -> AC -> compile -> FSDP,
    #    for the whole model or for each pipeline stage; then materialise + initialise the shards
    if mesh.cp_enabled:
        apply_cp_llama(model, mesh["cp"], seq_len=cfg.seq_len)
    spec = ParallelSpec(
        tp_plan=llama_tp_plan(),
        loss_parallel=True,
        blocks="layers",
        ac=args.ac,
        compile=args.compile,
        dtype=args.dtype,
        reshard_after_forward=reshard_after_forward(args),
    )

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    engine = build_engine(
        model,
        mesh,
        spec,
        strategy=args.strategy,
        device=info.device,
        max_grad_norm=args.grad_clip,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay),
        global_batch=args.batch_size,
        optimizer_args={"lr": args.lr, "weight_decay": args.weight_decay},
        offload_optimizer=args.offload_optimizer,
        seed=args.seed,
        pipeline_args=dict(
            loss_fn=loss_fn,
            microbatches=args.microbatches,
            schedule=pp_schedule(args),
            stages_per_rank=args.stages_per_rank,
            split_points=args.split_points,
        ),
    )
    del model
    if args.init_from:  # each rank reads only its shards from the safetensors files
        from mmm.parallel.hf_checkpoint import load_hf_llama

        load_hf_llama(engine.unwrapped(), args.init_from)
        log.info("weights loaded from %s", args.init_from)
    if info.is_main:
        if engine.pipeline is not None:
            log.info("%s", engine.pipeline.describe())
        else:
            log.info("model after parallelisation (%s, %s):\n%s", args.strategy, mesh.dims, engine.module)
        log.info("%s", describe_sharding(engine.module))
    startup.mark("parallelize")

    # 4. the loop: each dp rank takes its slice of the global batch; cp ranks their sequence shards
    ckpt, start, batches, run = loop_setup(args, info, outdir, startup, engine, cfg, mesh, dataset, log)
    tokens_per_step = args.batch_size * cfg.seq_len
    lr_at = schedule_from_args(args, total_steps=args.max_iters)  # the step's learning rate: warmup, decay
    heldout = flags.heldout_batches(args, cfg, mesh, info.device) if args.eval_every else None
    if info.is_main:
        if mesh.cp_enabled:
            log.info(
                "context parallel: ring attention over %d ranks, %d tokens each (chunks r and 2cp-1-r of %d)",
                mesh.cp,
                cfg.seq_len // mesh.cp,
                2 * mesh.cp,
            )
        log.info(
            "training steps %d-%d: global batch %d x %d tokens (%d per dp rank), dataset=%s, dtype=%s, out=%s",
            start,
            args.max_iters,
            args.batch_size,
            cfg.seq_len,
            args.batch_size // mesh.dp,
            dataset.name,
            args.dtype,
            outdir,
        )
    dist.graceful_sigterm()
    engine.train()
    with run:  # leaving on an error, the step read late is still written
        for step in range(start, args.max_iters + 1):
            poison = run.begin_step(step)
            lr = lr_at(step)
            set_lr(engine, lr)
            inputs, labels = next(batches)
            if mesh.cp_enabled:
                cp_rank = mesh.coord("cp")
                inputs, labels = shard_sequence(inputs, cp_rank, mesh.cp), shard_sequence(labels, cp_rank, mesh.cp)
            last = step == args.max_iters
            with run.measuring(mesh, enabled=args.measure and step == MEASURE_STEP):
                _, reduced, times = train_step(
                    engine,
                    inputs,
                    labels,
                    loss_fn,
                    sync=run.sync,
                    context=loss_parallel_context(mesh.tp_enabled),
                    poison=poison,
                    skip_nonfinite=args.on_nonfinite == "skip",
                    after_backward=(lambda: run.capture_memory(engine)) if last else None,
                )
            val = {}
            if eval_due(args, step, last=last):  # the held-out loss, left out of the step's dt
                t_eval = time.perf_counter()
                val_loss = evaluate(
                    engine, heldout, loss_fn, sync=run.sync, context=lambda: loss_parallel_context(mesh.tp_enabled)
                )
                val = {"val_loss": val_loss, "val_ppl": perplexity(val_loss), "dt_eval": time.perf_counter() - t_eval}
                run.exclude(val["dt_eval"])
            if run.end_step(
                step,
                reduced,
                times,
                args=args,
                checkpointer=ckpt,
                last=last,
                rates={"tps": tokens_per_step},
                grad_norm=engine.grad_norm,
                lr=lr,
                **val,
            ):
                break

    flags.export_hf(args, engine, cfg, info, run, log)  # --export-hf DIR: a Hugging Face checkpoint
    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "dtype": args.dtype,
        "ac": args.ac,
        "compile": args.compile,
        "compiled_graphs": compiled_graphs(),
        "reshard_after_forward": args.reshard_after_forward,
        "dataset": dataset.name,
        "model": {**vars(cfg), "num_params": n_params},
        "global_batch": args.batch_size,
        "tokens_per_step": tokens_per_step,
    }
    if engine.pipeline is not None:
        pipe = engine.pipeline
        extra["pipeline"] = {
            "schedule": pipe.schedule_name,
            "microbatches": pipe.microbatches,
            "stages": pipe.num_stages,
            "stages_per_rank": len(pipe.stage_ids),
            "layer_ranges": pipe.layer_ranges,
        }
    run.finish(
        engine,
        extra,
        mesh=mesh,
        num_params=n_params,
        plots=not args.no_plots,
        flops_per_unit=llama_flops_per_token(cfg),
        dtype=args.dtype,
    )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
