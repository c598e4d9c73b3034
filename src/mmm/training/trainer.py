"""The one trainer: :func:`main` parses a recipe's flags and sets the job up, :func:`train` runs it.

Read top to bottom, :func:`train` is the whole of a run for any :class:`~mmm.training.recipe.Recipe`:
the mesh, the model on ``meta``, its parallelisation, the checkpoints and the recorder, the steps
(:func:`mmm.training.loop.fit`) and the summary. What differs between models is the recipe's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmm import dist, env
from mmm.errors import UsageError
from mmm.log import get_logger
from mmm.parallel import describe_sharding, init_mesh, meta_init
from mmm.parallel.compose import mixed_precision
from mmm.parallel.optim import implementation
from mmm.training.checkpoints import open_checkpoints
from mmm.training.config import Config
from mmm.training.loop import fit
from mmm.training.recipe import RECIPE_HELP, Context, Recipe, recipe_named, split_recipe_flag
from mmm.training.recorder import Recorder
from mmm.training.startup import Startup, batch_problems, check_history_is_this_runs, start
from mmm.training.step import StepSync
from mmm.training.summary import compiled_graphs, torchinfo_summary, write_summary

# a layout chooser (mmm.plan.pick.take_pick): (recipe, config, argv, dist info) -> (config, the pick's record)
PickLayout = Callable[[Recipe, Config, list, Any], tuple[Config, dict]]


def checked(problems):
    """A recipe's ``problems`` and the trainer's own that every recipe needs, said once: the gradient
    accumulation's parts must split each rank's batch (mmm's recipes check it themselves; a recipe of
    your own need not)."""

    def check(config, world_size: int) -> list[str]:
        found = problems(config, world_size)
        dims = config.parallel.dims(world_size)
        if dims is not None and dims.pp == 1:
            found += [
                p
                for p in batch_problems(config.train.batch_size, dims.dp, microbatches=config.parallel.microbatches)
                if p not in found
            ]
        return found

    return check


def main(
    recipe: Recipe,
    argv: Sequence[str] | None = None,
    *,
    doc: str = "",
    pick: PickLayout | None = None,
    prog: str | None = None,
) -> int:
    """``python -m mmm.examples.<recipe.name>``: parse the flags (``doc``: --help's text), set the job up,
    check the config, train. ``pick``: how a run that asks for the planner's layout gets it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = recipe.command_line(doc, prog).parse(argv)  # the flags, parsed once into typed configs
    check_world = env.get("MMM_CHECK_WORLD")
    if check_world is not None:  # launch asks whether this job would run on that many ranks: nothing starts
        if dist.discover_ranks(use_mpi4py=False).world_size > 1:
            raise UsageError("MMM_CHECK_WORLD is launch's, for a one-process check of the flags; unset it in the job")
        check = recipe.layout_free_problems if recipe.picks_layout(config) else checked(recipe.problems)
        found = check(config, check_world)
        if found:
            raise UsageError("; ".join(found))
        print(f"{recipe.name}: the flags fit {check_world} ranks")
        return 0
    if recipe.picks_layout(config) and pick is None:
        raise UsageError(
            f"--pick-layout: this command takes no planner's pick; use python -m mmm.examples.{recipe.name}"
        )
    picking = pick is not None and recipe.picks_layout(config)
    # with a pick to come, the layout's checks wait for it (the pick runs them); the rest are checked now
    info, outdir, startup = start(
        recipe.name, config, recipe.layout_free_problems if picking else checked(recipe.problems)
    )
    chosen = None
    if picking:
        config, chosen = pick(recipe, config, argv, info)
    return train(recipe, config, info, outdir, startup, pick=chosen)


def train(recipe: Recipe, config: Config, info, outdir, startup: Startup, *, pick: dict | None = None) -> int:
    """Train ``recipe``'s model as ``config`` says (checked already) on the job ``info`` describes."""
    log = get_logger()
    # what to train (config.train, the recipe's own), how to parallelise it, how to run (seed, output, checkpoints)
    what, how = config.train, config.parallel
    # 1. the mesh: pp x dp_replicate x dp_shard x cp x tp
    mesh = init_mesh(**how.degrees)
    startup.mark("mesh")

    # 2. the model: plain single-device code built on `meta` (no memory yet); each rank materialises only
    #    its own shards in step 3, every weight seeded by --seed and its name (any mesh, the same weights)
    cfg = recipe.model_config(what)
    if info.device.type == "cpu":  # a large model in host memory: freed tensors go back at once (decided
        dist.return_freed_host_memory(4 * recipe.param_count(cfg))  # before tensors come and go)
    with meta_init():
        model = recipe.build(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if info.is_main:
        log.info("%s", recipe.describe(cfg))
        log.info("%s", torchinfo_summary(model))
    mesh.seed_streams(config.run.seed)  # own dropout masks per dp rank from here on
    startup.mark("model")

    # 3. parallelise: the recipe's own changes first (e.g. ring attention under cp), then its spec
    #    (TP plan -> AC -> compile -> FSDP/HSDP/DDP, or ZeRO, or each pipeline stage), AdamW, clipping
    recipe.prepare(model, mesh, cfg, how)
    engine = recipe.make_engine(model, mesh, config, device=info.device, spec=recipe.spec(how, cfg))
    del model
    recipe.loaded(engine, config, log)
    if info.is_main:
        if engine.pipeline is not None:
            log.info("%s", engine.pipeline.describe())
        else:
            log.info("model after parallelisation (%s, %s):\n%s", how.strategy, mesh.dims, engine.module)
        log.info("%s", describe_sharding(engine.module))
        if engine.microbatches > 1:
            local = config.train.batch_size // mesh.dp
            log.info(
                "gradient accumulation: %d microbatches of %d per rank (one optimizer step over the global batch "
                "of %d)",
                engine.microbatches,
                local // engine.microbatches,
                config.train.batch_size,
            )
    startup.mark("parallelize")

    # 4. the loop: the recipe's data, batches and schedule; checkpoints (and where to start), the recorder
    ctx = Context(
        config=config,
        model_config=cfg,
        mesh=mesh,
        engine=engine,
        info=info,
        outdir=outdir,
        log=log,
        num_params=n_params,
    )
    loop = recipe.loop(ctx)
    per_step = recipe.per_step(what, cfg)  # tokens or samples
    meta = {
        "example": recipe.name,
        "model": recipe.summary(cfg),
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "seed": config.run.seed,
        "global_batch": what.batch_size,
        **loop.meta,
    }
    checkpoints, ctx.start = open_checkpoints(  # the rows kept in --outdir must be the resumed run's own
        engine,
        config.run,
        meta=meta,
        startup=startup,
        log=log,
        extra_at=loop.extra_at,
        check=lambda saved: check_history_is_this_runs(outdir, saved),
    )
    if ctx.start > loop.last_step:  # resumed at or past the end of the run
        length = "--max-iters" if hasattr(what, "max_iters") else "the run's length"
        if ctx.start - 1 > loop.last_step:
            raise UsageError(
                f"the checkpoint of step {ctx.start - 1} is past this run's last step {loop.last_step}: raise "
                f"{length} to train on from it, or resume an earlier step"
            )
        # its outputs written and nothing asked of its end (an export, a saved model): nothing to do; else
        # no step runs, but the run's end does (a relaunch after a kill during the export finishes it)
        finishing = [f for f in ("export_hf", "save_model") if getattr(what, f, None)]
        summarised = (outdir / "summary.json").is_file()
        if not finishing and (summarised or not (outdir / "history.jsonl").is_file()):  # no rows to summarise
            where = f", and its outputs are in {outdir}" if summarised else ""
            log.info(
                "nothing to train: the checkpoint of step %d is this run's last step%s; raise %s to train on",
                ctx.start - 1,
                where,
                length,
            )
            if checkpoints.checkpointer is not None:
                checkpoints.checkpointer.close()
            return 0
        log.info(
            "no step to train: the checkpoint of step %d is this run's last step; finishing the run", ctx.start - 1
        )
    ctx.run = Recorder(
        recipe.name,
        info=info,
        outdir=outdir,
        startup=startup,
        config=config,
        resume_step=ctx.start - 1,
        continues=checkpoints.continues,
        sync=StepSync.for_engine(engine, device=info.device),
        last_good=checkpoints.last_good,
    )
    if info.is_main and ctx.start <= loop.last_step:
        log.info(
            "training steps %d-%d: global batch %d (%d per dp rank; %d %s per step), dtype=%s, out=%s",
            ctx.start,
            loop.last_step,
            what.batch_size,
            what.batch_size // mesh.dp,
            per_step,
            "tokens" if recipe.rate == "tps" else "samples",
            how.dtype,
            outdir,
        )
    measure_step = recipe.measure_step(config)
    if measure_step is not None and ctx.start > 1 and measure_step <= ctx.start:  # resumed: its own second step
        measure_step = min(ctx.start + 1, loop.last_step)
        ctx.log.info("--measure: this run starts at step %d, so it watches step %d", ctx.start, measure_step)
    fit(
        engine,
        ctx.run,
        checkpoints,
        steps=range(ctx.start, loop.last_step + 1),
        batch=loop.batch,
        loss_fn=recipe.loss,
        rates={recipe.rate: per_step},
        lr_at=loop.lr_at,
        evaluate=loop.evaluate,
        after_update=loop.after_update,
        after_step=loop.after_step,
        skip_nonfinite=config.run.on_nonfinite == "skip",
        measure_step=measure_step,
        mesh=mesh,
    )

    # 5. the end: the recipe's own (exports), then summary.json, history.nc, the plots and the closing line
    extra = {
        "mesh": mesh.dims.degrees,
        "strategy": how.strategy,
        "dtype": how.dtype,
        "mixed_precision": mixed_precision(engine.module) if hasattr(engine, "optimizer") else "deepspeed",
        # how AdamW steps: fused, or torch's default (DeepSpeed's own under ZeRO)
        "optimizer": implementation(engine.optimizer) if hasattr(engine, "optimizer") else "deepspeed",
        "ac": how.ac,
        "compile": how.compile,
        "compiled_graphs": compiled_graphs(),
        "reshard_after_forward": how.reshard_after_forward,
        "model": {**recipe.summary(cfg), "num_params": n_params},
        "global_batch": what.batch_size,
        **(loop.finish() if loop.finish is not None else {}),
    }
    if engine.microbatches > 1:  # gradient accumulation (a pipeline's microbatches are under "pipeline")
        extra["accumulation"] = {"microbatches": engine.microbatches}
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
        ctx.run,
        engine,
        extra,
        mesh=mesh,
        num_params=n_params,
        plots=not config.run.no_plots,
        rate_key=recipe.rate,
        flops_per_unit=recipe.flops_per_unit(cfg),
        dtype=how.dtype,
    )
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m mmm.training.trainer --recipe NAME|module:NAME [its flags]``: any recipe, the one trainer."""
    name, rest = split_recipe_flag(sys.argv[1:] if argv is None else argv)
    recipe = recipe_named(name)
    module = sys.modules.get(type(recipe).__module__)
    about = (type(recipe).__doc__ or getattr(module, "__doc__", None) or "").strip().split("\n\n")[0]
    doc = f"""Train {recipe.name} with mmm's one trainer{": " + about if about else "."}

    python -m mmm.training.trainer --recipe NAME|module:NAME [the recipe's flags]

--recipe: {RECIPE_HELP}.
"""
    return main(recipe, rest, doc=doc, prog=f"python -m mmm.training.trainer --recipe {name or 'llama'}")


if __name__ == "__main__":
    dist.run_main(cli, prog="python -m mmm.training.trainer")
