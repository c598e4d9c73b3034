"""Train a Llama-style model with tensor/sequence parallel + FSDP2 (or HSDP, or DDP) on a (dp, tp) mesh.

    launch -n 4 python3 -m mmm.examples.fsdp_tp --tpsize 2          # dp=2 x tp=2 on CPU ranks
    launch python3 -m mmm.examples.fsdp_tp --tp 4 --dim 2048 ...     # a GPU allocation, same flags

--batch-size is the GLOBAL batch (sequences per optimizer step), split evenly over dp ranks;
with the same --seed and global batch the per-step losses are the same on any mesh.
Writes history.jsonl (live), history.nc, summary.json and plots/ to --outdir.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import replace

import torch

from mmm import dist
from mmm.data import make_dataset
from mmm.errors import UsageError
from mmm.flops import llama_flops_per_token
from mmm.log import get_logger
from mmm.models.llama import Llama, apply_cp_llama, load_hf_llama
from mmm.parallel import describe_sharding, init_mesh, meta_init
from mmm.parallel.context import shard_sequence
from mmm.plan.pick import planners_pick
from mmm.training import llama as recipe
from mmm.training.config import Config
from mmm.training.evaluation import perplexity
from mmm.training.llama import MEASURE_STEP, LlamaTrainConfig, command_line, loop_setup
from mmm.training.loop import fit
from mmm.training.startup import start
from mmm.training.step import evaluate
from mmm.training.summary import compiled_graphs, torchinfo_summary, write_summary

EXAMPLE = "fsdp_tp"


def build_parser():
    return command_line(__doc__).parser()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = command_line(__doc__).parse(argv)  # the flags, parsed once into typed configs
    picking = bool(config.train.pick_layout)  # --pick-layout HARDWARE: the planner's layout for this world
    # with a pick to come, the layout's checks wait for it (take_pick); the rest are checked at once
    info, outdir, startup = start(EXAMPLE, config, recipe.layout_free_problems if picking else recipe.problems)
    pick = None
    if picking:
        config, pick = take_pick(config, argv, info)
    return train(config, info, outdir, startup, pick)


def take_pick(config: Config[LlamaTrainConfig], argv: list[str], info) -> tuple[Config[LlamaTrainConfig], dict]:
    """Rank 0 asks the planner (mmm.plan.pick); every rank takes its layout."""
    found: list = [None]
    failure: BaseException | None = None
    if info.is_main:
        try:
            found = [
                planners_pick(argv, info.world_size, config.train.pick_layout, devices_per_node=info.local_world_size)
            ]
        except UsageError as e:
            found = [("usage", str(e))]
        except Exception as e:  # a bug: rank 0 keeps its traceback, the others must not wait for a pick
            failure, found = e, [("failed", f"rank 0's planner failed: {type(e).__name__}: {e}")]
    if torch.distributed.is_initialized() and info.world_size > 1:
        torch.distributed.broadcast_object_list(found, src=0)
    if failure is not None:
        raise failure
    if isinstance(found[0], tuple):
        kind, message = found[0]
        raise UsageError(message) if kind == "usage" else RuntimeError(message)
    pick = found[0]
    # the planner's activation checkpointing and pipeline microbatches, where it chose them (given ones hold)
    chosen = {k: pick[k] for k in ("ac", "microbatches") if pick[k]}
    config = replace(config, parallel=replace(config.parallel, **pick["degrees"], strategy=pick["strategy"], **chosen))
    problems = recipe.problems(config, info.world_size)
    if problems:
        raise RuntimeError(f"the planner picked {pick['label']}, which the trainer refuses: {'; '.join(problems)}")
    if info.is_main:
        log = get_logger()
        log.info(
            "layout: the planner picked %s of %d on %s in %.0f s: predicted step %.1f ms (%s)",
            pick["label"],
            pick["layouts"],
            pick["hardware"],
            pick["seconds"],
            pick["predicted_step_s"] * 1e3,
            pick["why"],
        )
        for i, r in enumerate(pick["ranked"][1:], 2):
            log.info("layout: #%d %s, predicted %.1f ms (%s)", i, r["label"], r["step_s"] * 1e3, r["why"])
    return config, pick


def train(config: Config[LlamaTrainConfig], info, outdir, startup, pick: dict | None = None) -> int:
    log = get_logger()
    # what to train (model, data, batch, steps, lr schedule), how to parallelise it (mesh, strategy, pipeline, ...);
    # config.run: seed, output, checkpoints, trackers (mmm.training.config)
    what, how = config.train, config.parallel
    # 1. the mesh: pp x dp_replicate x dp_shard x cp x tp
    mesh = init_mesh(**how.degrees)
    startup.mark("mesh")

    # 2. the model: plain single-device code, built on `meta` (no memory yet); each rank materialises
    #    only its own shards after step 3, every weight seeded by --seed and its name (any mesh, same weights)
    cfg = what.model_config()
    dataset = make_dataset(what.dataset, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, **what.data_options())
    if info.device.type == "cpu":  # a large model in host memory: freed tensors go back at once (decided early)
        dist.return_freed_host_memory(4 * cfg.num_params())
    with meta_init():
        model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("model: %s", cfg)
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(config.run.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")

    # 3. parallelise: context parallel swaps in ring attention; then TP -> AC -> compile -> FSDP,
    #    for the whole model or for each pipeline stage; then materialise + initialise the shards
    if mesh.cp_enabled:
        apply_cp_llama(model, mesh["cp"], seq_len=cfg.seq_len)
    # the spec (recipe.parallel_spec): TP plan (data) + loss parallel, blocks for AC/compile/FSDP; the
    # strategy, AdamW, clipping and the pipeline from the flags (recipe.make_engine calls build_engine)
    engine = recipe.make_engine(model, mesh, config, device=info.device)
    del model
    if what.init_from:  # each rank reads only its shards from the safetensors files
        load_hf_llama(engine.unwrapped(), what.init_from)
        log.info("weights loaded from %s", what.init_from)
    if info.is_main:
        if engine.pipeline is not None:
            log.info("%s", engine.pipeline.describe())
        else:
            log.info("model after parallelisation (%s, %s):\n%s", how.strategy, mesh.dims, engine.module)
        log.info("%s", describe_sharding(engine.module))
    startup.mark("parallelize")

    # 4. the loop: each dp rank takes its slice of the global batch; cp ranks their sequence shards
    checkpoints, start, batches, run = loop_setup(config, info, outdir, startup, engine, cfg, mesh, dataset, log)
    heldout = recipe.heldout_batches(config, cfg, mesh, info.device) if what.eval_every else None
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
            what.max_iters,
            what.batch_size,
            cfg.seq_len,
            what.batch_size // mesh.dp,
            dataset.name,
            how.dtype,
            outdir,
        )

    def batch(step):  # this rank's rows of the step's global batch (and its sequence shard under cp)
        inputs, labels = next(batches)
        if mesh.cp_enabled:
            cp_rank = mesh.coord("cp")
            inputs, labels = shard_sequence(inputs, cp_rank, mesh.cp), shard_sequence(labels, cp_rank, mesh.cp)
        return inputs, labels

    def held_out(step, last):  # the held-out loss every --eval-every steps (left out of the step's dt)
        if not what.eval_due(step, last=last):
            return {}
        val_loss = evaluate(engine, heldout, recipe.loss_fn, sync=run.sync)
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss)}

    fit(
        engine,
        run,
        checkpoints,
        steps=range(start, what.max_iters + 1),
        batch=batch,
        loss_fn=recipe.loss_fn,
        rates={"tps": what.batch_size * cfg.seq_len},
        lr_at=what.schedule(total_steps=what.max_iters),  # the step's learning rate: warmup, decay
        evaluate=held_out,
        skip_nonfinite=config.run.on_nonfinite == "skip",
        measure_step=MEASURE_STEP if what.measure else None,
        mesh=mesh,
    )

    recipe.export_hf(what, engine, cfg, info, run, log)  # --export-hf DIR: a Hugging Face checkpoint
    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "dtype": how.dtype,
        "ac": how.ac,
        "compile": how.compile,
        "compiled_graphs": compiled_graphs(),
        "reshard_after_forward": how.reshard_after_forward,
        "dataset": dataset.name,
        "model": {**vars(cfg), "num_params": n_params},
        "global_batch": what.batch_size,
        "tokens_per_step": what.batch_size * cfg.seq_len,
    }
    if pick is not None:
        extra["layout_pick"] = pick  # --pick-layout: what the planner picked, predicted, and why
    if engine.pipeline is not None:
        pipe = engine.pipeline
        extra["pipeline"] = {
            "schedule": pipe.schedule_name,
            "microbatches": pipe.microbatches,
            "stages": pipe.num_stages,
            "stages_per_rank": len(pipe.stage_ids),
            "layer_ranges": pipe.layer_ranges,
        }
    write_summary(
        run,
        engine,
        extra,
        mesh=mesh,
        num_params=n_params,
        plots=not config.run.no_plots,
        flops_per_unit=llama_flops_per_token(cfg),
        dtype=how.dtype,
    )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog=f"python -m mmm.examples.{EXAMPLE}")
