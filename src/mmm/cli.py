"""Flags shared by mmm's programs, with the spellings already in circulation as aliases."""

from __future__ import annotations

import argparse

from mmm.errors import ArgumentParser

__all__ = [
    "ArgumentParser",
    "add_mesh_args",
    "add_output_args",
    "add_strategy_args",
    "nonnegative_int",
    "output_arg_problems",
    "positive_int",
]


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def nonnegative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def degree(text: str) -> int:
    value = _integer(text)
    if value < 1 and value != -1:
        raise argparse.ArgumentTypeError(f"{value} is not a degree: use a positive integer, or -1 to infer it")
    return value


def add_mesh_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """``--tp/--tpsize``, ``--pp/--ppsize``, ``--cp/--cpsize``, ``--dp-replicate``, ``--dp-shard``."""
    g = parser.add_argument_group("device mesh (pp x dp_replicate x dp_shard x cp x tp = world size)")
    g.add_argument(
        "--tp",
        "--tpsize",
        dest="tp",
        type=degree,
        default=1,
        metavar="N",
        help="tensor-parallel degree (innermost axis, keep within a node) [1]",
    )
    g.add_argument(
        "--pp",
        "--ppsize",
        dest="pp",
        type=degree,
        default=1,
        metavar="N",
        help="pipeline-parallel degree (outermost axis) [1]",
    )
    g.add_argument(
        "--cp",
        "--cpsize",
        dest="cp",
        type=degree,
        default=1,
        metavar="N",
        help="context-parallel degree (sequence split across ranks) [1]",
    )
    g.add_argument(
        "--dp-replicate",
        "--dp_replicate",
        dest="dp_replicate",
        type=degree,
        default=1,
        metavar="N",
        help="data-parallel replicas (HSDP outer axis) [1]",
    )
    g.add_argument(
        "--dp-shard",
        "--dp_shard",
        dest="dp_shard",
        type=degree,
        default=-1,
        metavar="N",
        help="data-parallel shards (FSDP axis); -1 infers it from the world size [-1]",
    )
    return g


def add_strategy_args(parser: argparse.ArgumentParser, *, default: str = "fsdp", dp_replicate: bool = True):
    """``--strategy`` (ddp, fsdp, hsdp, zero1/2/3), ``--dp-replicate`` (unless the mesh flags have it),
    ``--offload-optimizer``."""
    from mmm.parallel.strategy import STRATEGIES

    g = parser.add_argument_group("data parallelism")
    g.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=default,
        help="ddp: DDP; fsdp: FSDP2 over all dp ranks; hsdp: FSDP2 replicate x shard (needs "
        f"--dp-replicate); zero1/zero2/zero3: DeepSpeed ZeRO stages [{default}]",
    )
    if dp_replicate:
        g.add_argument(
            "--dp-replicate",
            "--dp_replicate",
            dest="dp_replicate",
            type=positive_int,
            default=1,
            metavar="N",
            help="HSDP replicas (with --strategy hsdp) [1]",
        )
    g.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="zero1/2/3 only: keep optimizer state on the CPU (DeepSpeed's own AdamW)",
    )
    return g


def add_output_args(parser: argparse.ArgumentParser, example: str, *, log_every: int = 1):
    """``--outdir``, ``--log-every``, ``--warmup``, ``--no-plots``; the trackers ``--wandb``
    (``--wandb-project``, ``--wandb-name``) and ``--tensorboard``; ``--rank-timings``."""
    g = parser.add_argument_group("output")
    g.add_argument("--outdir", default=None, help=f"output folder [outputs/{example}/<UTC timestamp>]")
    g.add_argument(
        "--log-every",
        "--log_every",
        dest="log_every",
        type=positive_int,
        default=log_every,
        help=f"print every N steps [{log_every}]",
    )
    g.add_argument("--warmup", type=nonnegative_int, default=2, help="steps excluded from timing statistics [2]")
    g.add_argument("--no-plots", action="store_true", help="skip text and image plots at the end")
    t = parser.add_argument_group("tracking (rank 0 only, fed by the history; optional extras)")
    t.add_argument(
        "--wandb",
        action="store_true",
        help="log every history row to Weights & Biases, the run under <outdir>/wandb (WANDB_MODE=offline: "
        "no network, `wandb sync` it later); needs pip install 'mmm[wandb]'",
    )
    t.add_argument(
        "--wandb-project",
        "--wandb_project",
        dest="wandb_project",
        default=None,
        metavar="NAME",
        help="W&B project [WANDB_PROJECT or mmm]",
    )
    t.add_argument(
        "--wandb-name",
        "--wandb_name",
        dest="wandb_name",
        default=None,
        metavar="NAME",
        help="W&B run name [WANDB_NAME or W&B's own]",
    )
    t.add_argument(
        "--tensorboard",
        action="store_true",
        help="write TensorBoard event files to <outdir>/tensorboard, a scalar per history key; needs "
        "pip install 'mmm[tensorboard]'",
    )
    t.add_argument(
        "--rank-timings",
        "--rank_timings",
        dest="rank_timings",
        action="store_true",
        help="on logging steps, gather every rank's dt (one small all-gather over all ranks): dt_min, "
        "dt_max, dt_mean, slowest_rank and dt_lag in the history, so a straggler shows",
    )
    return g


def output_arg_problems(args) -> list[str]:
    """Problems with the flags :func:`add_output_args` adds: a tracker whose package does not import
    (checked on every rank, so every rank stops alike)."""
    from mmm.tracking import tracker_problems

    out = tracker_problems(args)
    for flag in ("wandb_project", "wandb_name"):
        if getattr(args, flag, None) is not None and not getattr(args, "wandb", False):
            out.append(f"--{flag.replace('_', '-')} only applies with --wandb; add --wandb or drop it")
    return out


def add_checkpoint_args(parser) -> None:
    """``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``, ``--keep-last``."""
    g = parser.add_argument_group("checkpointing (torch Distributed Checkpoint; DeepSpeed's own for zero1/2/3)")
    g.add_argument(
        "--checkpoint-dir",
        "--checkpoint_dir",
        dest="checkpoint_dir",
        default=None,
        metavar="DIR",
        help="save checkpoints here (step-NNNNNNNN/ folders, each complete or absent) [off]",
    )
    g.add_argument(
        "--checkpoint-every",
        "--checkpoint_every",
        dest="checkpoint_every",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="save every N steps; the last step and SIGTERM always save [0]",
    )
    g.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="latest|STEP",
        help="continue from the latest checkpoint in --checkpoint-dir (a fresh start when there is none "
        "yet; a bare --resume means latest) or from a given step; the mesh may differ from the "
        "one that saved it",
    )
    g.add_argument(
        "--keep-last",
        "--keep_last",
        dest="keep_last",
        type=nonnegative_int,
        default=0,
        metavar="K",
        help="keep only the K newest checkpoints; 0 keeps all [0]",
    )


def add_run_args(parser: argparse.ArgumentParser):
    """What keeps a long job safe: checkpointing (``--checkpoint-dir``, ``--checkpoint-every``,
    ``--resume``, ``--keep-last``), ``--timeout`` and ``--on-nonfinite``."""
    add_checkpoint_args(parser)
    g = parser.add_argument_group("failures")
    g.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="collective timeout: a rank that stalls this long makes the others fail with a clear "
        "message [MMM_TIMEOUT or 600]",
    )
    g.add_argument(
        "--on-nonfinite",
        "--on_nonfinite",
        dest="on_nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a NaN/inf loss: stop with an error naming the step (the last checkpoint stays the last good "
        "one), or skip that step's update (torch strategies) [stop]",
    )
    return g


def run_arg_problems(args) -> list[str]:
    """Problems with the flags :func:`add_run_args` adds, and those of :func:`output_arg_problems`
    (every trainer asks this)."""
    from mmm.parallel.checkpoint import checkpoint_problems

    out = checkpoint_problems(args.checkpoint_dir, args.resume, args.checkpoint_every, args.keep_last)
    out += output_arg_problems(args)
    if args.timeout is not None and not args.timeout > 0:
        out.append(f"--timeout {args.timeout:g} must be a positive number of seconds")
    if args.on_nonfinite == "skip" and getattr(args, "strategy", "").startswith("zero"):
        out.append(
            f"--on-nonfinite skip needs a torch strategy (ddp, fsdp, hsdp), not {args.strategy}: DeepSpeed "
            "must step after every backward; use --on-nonfinite stop"
        )
    return out
