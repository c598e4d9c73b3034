"""Flags and checks of the Llama trainer (``python -m mmm.examples.fsdp_tp``), shared with the
planner (``python -m mmm.plan`` asks :func:`arg_problems` of every layout, so the two never
disagree) and kept here so that the example reads as a tutorial."""

from __future__ import annotations

from mmm.cli import (
    ArgumentParser,
    add_mesh_args,
    add_output_args,
    add_run_args,
    add_strategy_args,
    positive_int,
    run_arg_problems,
)
from mmm.errors import UsageError
from mmm.training.evaluation import add_eval_args, eval_problems
from mmm.training.schedule import add_schedule_args, schedule_from_args, schedule_problems

EXAMPLE = "fsdp_tp"
# the model-shape flags' defaults (--init-from takes the shape from a checkpoint's config instead)
MODEL_DEFAULTS = {"dim": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": None, "vocab_size": None}
DEFAULT_VOCAB = 256  # bytes: the vocabulary when neither --vocab-size nor the data gives one
MEASURE_STEP = 2  # --measure watches this step (a warmup step with the default --warmup 2)


def build_parser(doc: str = "") -> ArgumentParser:
    """The trainer's flags; ``doc`` (the trainer's docstring) gives the description and epilog."""
    from mmm.data import DATASETS
    from mmm.parallel.activation_checkpoint import AC_MODES
    from mmm.parallel.pipeline import SCHEDULES

    parts = doc.split("\n\n", 2)
    p = ArgumentParser(
        prog=f"python -m mmm.examples.{EXAMPLE}", description=parts[0], epilog=parts[2] if len(parts) > 2 else None
    )
    add_mesh_args(p)
    g = add_strategy_args(p, dp_replicate=False)  # --dp-replicate is a mesh flag here
    g.add_argument(
        "--reshard-after-forward",
        choices=["auto", "true", "false"],
        default="auto",
        help="FSDP: free gathered parameters after forward (true: less memory, one more all-gather "
        "in backward); auto: every block but the root, and under --pp none (a stage keeps its "
        "parameters gathered over its microbatches) [auto]",
    )
    g = p.add_argument_group("pipeline parallel (with --pp > 1)")
    g.add_argument(
        "--pp-schedule",
        "--pp_schedule",
        dest="pp_schedule",
        choices=list(SCHEDULES),
        default=None,
        help="pipelining schedule; interleaved ones need --stages-per-rank >= 2 [1f1b]",
    )
    g.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="microbatches per step, dividing the per-dp-rank batch [pp]",
    )
    g.add_argument(
        "--stages-per-rank",
        "--stages_per_rank",
        dest="stages_per_rank",
        type=positive_int,
        default=1,
        help="pipeline stages each rank holds (looped placement) [1]",
    )
    g.add_argument(
        "--split-points",
        "--split_points",
        dest="split_points",
        type=_int_list,
        default=None,
        metavar="I,J,...",
        help="first block of each stage after the first [even split]",
    )
    g = p.add_argument_group("model (Llama-style)")
    g.add_argument("--dim", type=positive_int, default=MODEL_DEFAULTS["dim"], help="model width [256]")
    g.add_argument(
        "--n-layers",
        "--n_layers",
        dest="n_layers",
        type=positive_int,
        default=MODEL_DEFAULTS["n_layers"],
        help="transformer blocks [4]",
    )
    g.add_argument(
        "--n-heads",
        "--n_heads",
        dest="n_heads",
        type=positive_int,
        default=MODEL_DEFAULTS["n_heads"],
        help="attention heads (divisible by tp) [8]",
    )
    g.add_argument(
        "--n-kv-heads",
        "--n_kv_heads",
        dest="n_kv_heads",
        type=positive_int,
        default=MODEL_DEFAULTS["n_kv_heads"],
        help="key/value heads for grouped-query attention [= n-heads]",
    )
    g.add_argument(
        "--vocab-size",
        "--vocab_size",
        dest="vocab_size",
        type=positive_int,
        default=MODEL_DEFAULTS["vocab_size"],
        help="vocabulary; at least the data's [the data's (meta.json, --tokenizer), else 256]",
    )
    g.add_argument(
        "--seq-len", "--seq_len", dest="seq_len", type=positive_int, default=128, help="tokens per sequence [128]"
    )
    g.add_argument(
        "--init-from",
        dest="init_from",
        default=None,
        metavar="DIR",
        help="start from a Hugging Face Llama checkpoint (config.json + *.safetensors, e.g. from "
        "save_pretrained): the model's shape comes from its config.json, and each rank reads only "
        "its own shards of the weights",
    )
    g.add_argument(
        "--export-hf",
        dest="export_hf",
        default=None,
        metavar="DIR",
        help="after the last step write the weights as a Hugging Face Llama checkpoint (config.json + "
        "model.safetensors, and the data's tokenizer.json), loadable with transformers' "
        "LlamaForCausalLM.from_pretrained or --init-from",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive_int,
        default=16,
        help="GLOBAL batch in sequences per step, divisible by dp [16]",
    )
    g.add_argument(
        "--max-iters", "--max_iters", dest="max_iters", type=positive_int, default=40, help="optimizer steps [40]"
    )
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate [3e-3]")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay [0]")
    g.add_argument(
        "--grad-clip",
        "--grad_clip",
        dest="grad_clip",
        type=float,
        default=0.0,
        help="clip the global gradient L2 norm (over all shards and pipeline stages); 0 = off [0]",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of weights and data [0]")
    g.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="compute dtype; bf16 keeps fp32 master weights and fp32 gradient reduction [fp32]",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile each block")
    g.add_argument(
        "--ac",
        choices=AC_MODES,
        default="none",
        help="activation checkpointing: full block, or selective (keep matmul outputs) [none]",
    )
    g.add_argument(
        "--dataset",
        choices=DATASETS,
        default="synthetic",
        help="synthetic (learnable sequences), pydoc (byte-level English text shipped with Python), "
        "bin (token files DIR/train.bin, nanoGPT's format) or hf (a Hugging Face dataset saved "
        "with save_to_disk) [synthetic]",
    )
    g.add_argument(
        "--data-dir",
        "--data_dir",
        dest="data_dir",
        default=None,
        metavar="DIR",
        help="--dataset bin: the directory of train.bin / val.bin (uint16; uint32 as meta.json or the "
        "name train.uint32.bin says; python -m mmm.data prepare writes one); --dataset hf: the "
        "save_to_disk directory",
    )
    g.add_argument(
        "--text-column",
        dest="text_column",
        default=None,
        metavar="NAME",
        help="--dataset hf: the column to train on: text (tokenised at load) or lists of token ids "
        "[input_ids if there is one, else text]",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH|bytes",
        help="--dataset hf: a tokenizers tokenizer.json for the text column (its vocabulary sizes the "
        "model), or bytes [bytes]",
    )
    g.add_argument(
        "--measure",
        action="store_true",
        help="on step 2 (a warmup step) count the bytes each mesh process group communicates and "
        "the bytes of activations saved for backward, per rank, into summary.json "
        "(measured_per_rank); that step runs slower",
    )
    add_schedule_args(p)
    add_eval_args(p)
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
    from mmm.parallel.compose import compile_problems
    from mmm.parallel.context import cp_problems
    from mmm.parallel.pipeline import pipeline_problems
    from mmm.parallel.strategy import strategy_problems
    from mmm.parallel.tensor import tp_problems
    from mmm.training import batch_problems

    degrees = {a: getattr(args, a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
    _, problems = check_degrees(world_size, **degrees)
    mesh_ok = not problems
    if args.init_from:
        changed = [f"--{k.replace('_', '-')}" for k, v in MODEL_DEFAULTS.items() if getattr(args, k) != v]
        if changed:
            problems.append(
                f"{', '.join(changed)}: with --init-from the model's shape comes from "
                f"{args.init_from}/config.json; drop them"
            )
        if args.strategy.startswith("zero"):
            problems.append(
                f"--init-from loads into the torch-sharded model; --strategy {args.strategy} hands "
                "the model to DeepSpeed first: use --strategy fsdp, hsdp or ddp"
            )
    try:
        cfg = model_config(args)
    except UsageError as err:
        return problems + [str(err)]
    problems += cfg.problems()
    if mesh_ok:
        dims = ParallelDims(world_size=world_size, **degrees)
        problems += cp_problems(cp=dims.cp, seq_len=cfg.seq_len, tp=dims.tp)
        problems += pipeline_flag_problems(args, dims)
        if args.batch_size % dims.dp == 0:
            problems += pipeline_problems(
                pp=dims.pp,
                n_layers=cfg.n_layers,
                schedule=pp_schedule(args),
                stages_per_rank=args.stages_per_rank,
                microbatches=args.microbatches or dims.pp,
                local_batch=args.batch_size // dims.dp,
                split_points=args.split_points,
            )
        problems += strategy_problems(args.strategy, dims, offload_optimizer=args.offload_optimizer)
        problems += compile_problems(args.compile, dims)
        problems += tp_problems(
            tp=dims.tp, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len
        )
        problems += batch_problems(args.batch_size, dims.dp)
    problems += dataset_problems(args.dataset, vocab_size=cfg.vocab_size, **data_options(args))
    if args.export_hf and _is_file(args.export_hf):
        problems.append(f"--export-hf {args.export_hf!r} is a file; give a directory (it is created if missing)")
    if args.export_hf and args.strategy.startswith("zero"):
        problems.append(
            f"--export-hf gathers the torch-sharded model; --strategy {args.strategy} hands the model to "
            "DeepSpeed: use --strategy fsdp, hsdp or ddp"
        )
    if args.grad_clip < 0:
        problems.append(f"--grad-clip {args.grad_clip} must be >= 0 (0 turns clipping off)")
    problems += run_arg_problems(args)
    problems += schedule_problems(args, total_steps=args.max_iters)
    problems += eval_problems(args)
    if args.measure and args.max_iters < MEASURE_STEP:
        problems.append(
            f"--measure watches step {MEASURE_STEP}; --max-iters {args.max_iters} is too few "
            f"(use --max-iters {MEASURE_STEP} or more)"
        )
    return problems


def _is_file(path: str) -> bool:
    from pathlib import Path

    return Path(path).is_file()


def pp_schedule(args) -> str:
    return args.pp_schedule or "1f1b"


def pipeline_flag_problems(args, dims) -> list[str]:
    """Flags that only a pipeline or only FSDP can honour, given without one: refused, never ignored."""
    from mmm.parallel.compose import shards_parameters

    out = []
    if dims.pp == 1:
        given = [
            f
            for f, v in (
                ("--pp-schedule", args.pp_schedule),
                ("--microbatches", args.microbatches),
                ("--split-points", args.split_points),
            )
            if v is not None
        ]
        given += ["--stages-per-rank"] if args.stages_per_rank != 1 else []
        if given:
            out.append(f"{', '.join(given)} only apply with --pp > 1 (got pp=1); add --pp N or drop them")
    if args.reshard_after_forward != "auto" and not shards_parameters(dims, args.strategy):
        out.append(
            f"--reshard-after-forward {args.reshard_after_forward} is an FSDP option; --strategy "
            f"{args.strategy} with dp={dims.dp}, cp={dims.cp} does not shard parameters (use --strategy fsdp "
            "over dp or cp > 1, or drop the flag)"
        )
    return out


def check_args(args, world_size: int) -> None:
    """Every problem with the flags for this world size, at once, as one UsageError."""
    problems = arg_problems(args, world_size)
    if problems:
        raise UsageError("; ".join(problems))


def reshard_after_forward(args) -> bool | None:
    return {"auto": None, "true": True, "false": False}[args.reshard_after_forward]


def checkpoint_meta(args, cfg, mesh) -> dict:
    """What a checkpoint records about the run; ``model`` must match to resume."""
    return {
        "example": EXAMPLE,
        "model": dict(vars(cfg)),
        "mesh": mesh.dims.degrees,
        "strategy": args.strategy,
        "seed": args.seed,
        "global_batch": args.batch_size,
        "dataset": args.dataset,
        "lr_schedule": schedule_from_args(args, total_steps=args.max_iters).as_dict(),
    }


def loop_setup(args, info, outdir, startup, engine, cfg, mesh, dataset, log):
    """What both training loops start from: the checkpointer, the first step (after ``--resume``),
    this dp rank's batches from that step on, and the Run that records the steps."""
    from mmm.data import local_batches
    from mmm.training import Run, StepSync, make_checkpointer, resume

    ckpt = make_checkpointer(args, engine, meta=checkpoint_meta(args, cfg, mesh), log=log)
    start = resume(args, ckpt, startup)
    batches = local_batches(
        dataset,
        seed=args.seed,
        global_batch=args.batch_size,
        dp_rank=mesh.coord("dp"),
        dp_size=mesh.dp,
        start_step=start - 1,
        device=info.device,
    )
    run = Run(
        EXAMPLE,
        info=info,
        outdir=outdir,
        startup=startup,
        warmup=args.warmup,
        log_every=args.log_every,
        resume_step=start - 1,
        sync=StepSync.for_engine(engine, device=info.device),
    )
    return ckpt, start, batches, run


def heldout_batches(args, cfg, mesh, device) -> list:
    """This rank's part of the ``--eval-iters`` held-out global batches (the same ones at every
    evaluation; the data's ``val`` split), sharded over the sequence under context parallel."""
    from mmm.data import local_batches, make_dataset
    from mmm.parallel.context import shard_sequence

    val = make_dataset(args.dataset, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, split="val", **data_options(args))
    stream = local_batches(
        val,
        seed=args.seed,
        global_batch=args.batch_size,
        dp_rank=mesh.coord("dp"),
        dp_size=mesh.dp,
        start_step=0,
        device=device,
    )
    out = [next(stream) for _ in range(args.eval_iters)]
    if mesh.cp_enabled:
        r = mesh.coord("cp")
        out = [(shard_sequence(x, r, mesh.cp), shard_sequence(y, r, mesh.cp)) for x, y in out]
    return out


def model_config(args):
    """The model's shape: the flags (the vocabulary: --vocab-size, else the data's, else 256), or
    --init-from's config.json."""
    from mmm.models.llama import LlamaConfig

    if getattr(args, "init_from", None):
        from mmm.parallel.hf_checkpoint import llama_config_from_hf

        return llama_config_from_hf(args.init_from, seq_len=args.seq_len)
    vocab = args.vocab_size
    if vocab is None:
        from mmm.data import data_vocab_size

        vocab = (
            data_vocab_size(
                getattr(args, "dataset", "synthetic"),
                data_dir=getattr(args, "data_dir", None),
                tokenizer=getattr(args, "tokenizer", None),
            )[0]
            or DEFAULT_VOCAB
        )
    return LlamaConfig(
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        vocab_size=vocab,
        seq_len=args.seq_len,
    )


def data_options(args) -> dict:
    """The flags that say where --dataset bin / hf read from (for mmm.data.make_dataset)."""
    return {k: getattr(args, k, None) for k in ("data_dir", "text_column", "tokenizer")}


def export_hf(args, engine, cfg, info, run, log) -> None:
    """--export-hf DIR after the last step (not after a SIGTERM stop): every rank takes part in the
    gather, rank 0 writes; the data's tokenizer.json goes along when there is one."""
    if not args.export_hf:
        return
    if run.stopped_by is not None:
        if info.is_main:
            log.info("--export-hf skipped: the run stopped early (%s); resume it to the last step", run.stopped_by)
        return
    import shutil
    from pathlib import Path

    from mmm.parallel.hf_checkpoint import export_hf_llama

    pp_group = engine.pipeline.pp_group if engine.pipeline is not None else None
    out = export_hf_llama(engine.unwrapped(), args.export_hf, cfg, pp_group=pp_group)
    tokenizer = (
        Path(args.tokenizer)
        if args.tokenizer not in (None, "bytes")
        else Path(args.data_dir) / "tokenizer.json"
        if args.dataset == "bin" and args.data_dir
        else None
    )
    if out is not None and tokenizer is not None and tokenizer.is_file():
        shutil.copyfile(tokenizer, out / "tokenizer.json")
    if info.is_main:
        log.info("Hugging Face checkpoint written to %s (config.json, model.safetensors)", args.export_hf)
