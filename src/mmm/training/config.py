"""Typed configuration of the trainers: what to train, how to parallelise it, how to run it.

A trainer's :class:`Config` holds three dataclasses:

- ``train``: what to train, the trainer's own class (the model's shape, the data, the batch, the
  steps, the learning rate and its schedule, evaluation), e.g. :class:`mmm.models.llama.recipe.LlamaTrainConfig`;
- ``parallel``: :class:`ParallelConfig`, how to parallelise it (the mesh's degrees, the data-parallel
  strategy, the pipeline, activation checkpointing, compile, compute dtype);
- ``run``: :class:`RunConfig`, how to run it (seed, output, logging, trackers, checkpoints, failures).

Each field carries its help text and its flag spellings (:func:`mmm.cli.option`; the first spelling
is the documented one, the others stay accepted as aliases). The command line is generated from
them and parsed once (:func:`trainer_flags`); everything below takes these objects or their fields.
Each class checks its own values (``problems``: every problem at once, each naming the value and
the fix); the checks that need the world size and the model are the trainer's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from mmm.cli import (
    FLAGS,
    Flags,
    MeshConfig,
    flag_problems,
    int_list,
    nonnegative_int,
    option,
    positive_int,
    random_seed,
    seconds,
)
from mmm.errors import only_with
from mmm.parallel.activation_checkpoint import AC_MODES
from mmm.parallel.checkpoint_folder import checkpoint_problems
from mmm.parallel.compose import ac_problems, compile_problems, shards_parameters
from mmm.parallel.context import CP_KINDS
from mmm.parallel.float8 import float8_problems
from mmm.parallel.mesh import ParallelDims, check_degrees
from mmm.parallel.pipeline import SCHEDULES
from mmm.parallel.strategy import STRATEGIES, strategy_problems
from mmm.tracking import EXTRAS, tracker_problems

T = TypeVar("T")


@dataclass
class ParallelConfig(MeshConfig):
    """How to parallelise: the mesh's degrees (:class:`mmm.cli.MeshConfig`), the data-parallel
    strategy, the pipeline, and what each block gets (activation checkpointing, compile, dtype)."""

    strategy: str = option(
        "fsdp",
        "--strategy",
        choices=STRATEGIES,
        group="dp",
        help="ddp: DDP (no tp, cp or pp); fsdp: FSDP2 over all dp ranks; hsdp: FSDP2 replicate x shard (needs "
        "--dp-replicate); zero1/zero2/zero3: DeepSpeed ZeRO stages (data parallel only)",
    )
    offload_optimizer: bool = option(
        False,
        "--offload-optimizer",
        group="dp",
        help="zero1/2/3 only: keep optimizer state on the CPU (DeepSpeed's own AdamW)",
    )
    reshard_after_forward: str = option(
        "auto",
        "--reshard-after-forward",
        choices=("auto", "true", "false"),
        group="dp",
        help="FSDP: free gathered parameters after forward (true: less memory, one more all-gather in backward); "
        "auto: every block but the root, and under --pp none (a stage keeps its parameters gathered over its "
        "microbatches)",
    )
    pp_schedule: str | None = option(
        None,
        "--pp-schedule",
        choices=tuple(SCHEDULES),
        shown="1f1b",
        group="pipeline",
        help="pipelining schedule; interleaved ones need --stages-per-rank >= 2",
    )
    microbatches: int | None = option(
        None,
        "--microbatches",
        parse=positive_int,
        shown="1; pp under --pp",
        group="pipeline",
        help="microbatches per step, dividing the per-dp-rank batch: gradient accumulation (one optimizer step "
        "over N forward/backward passes of 1/N of the batch each: the same step, activations for 1/N of it); "
        "under pipeline parallel (--pp, where the trainer has it), the pipeline's microbatches",
    )
    stages_per_rank: int = option(
        1,
        "--stages-per-rank",
        parse=positive_int,
        group="pipeline",
        help="pipeline stages each rank holds (looped placement)",
    )
    split_points: list[int] | None = option(
        None,
        "--split-points",
        parse=int_list,
        metavar="I,J,...",
        shown="even split",
        group="pipeline",
        help="first block of each stage after the first",
    )
    cp_attention: str = option(
        "ring",
        "--cp-attention",
        choices=CP_KINDS,
        group="mesh",
        help="with --cp > 1: ring (keys and values pass around the cp ranks; any head count) or ulysses "
        "(all-to-all: each rank attends over the whole sequence with heads / cp of the heads; query heads per "
        "TP rank divisible by cp, fewer bytes per rank at large cp)",
    )
    dtype: str = option(
        "fp32",
        "--dtype",
        choices=("fp32", "bf16"),
        group="training",
        help="compute dtype; bf16 keeps fp32 master weights and fp32 gradient reduction",
    )
    compile: bool = option(False, "--compile", group="training", help="torch.compile each block")
    float8: bool = option(
        False,
        "--float8",
        group="training",
        help="linear layers' matmuls in float8 (torchao; needs --dtype bf16, a CUDA device of compute capability "
        "8.9+ such as an H100, and tp=1; pays most with --compile); the output head stays bf16",
    )
    ac: str = option(
        "none",
        "--ac",
        choices=AC_MODES,
        group="training",
        help="activation checkpointing: full block, or selective (keep matmul outputs)",
    )

    @property
    def pipeline_schedule(self) -> str:
        return self.pp_schedule or "1f1b"

    @property
    def reshard(self) -> bool | None:
        """``reshard_after_forward`` for FSDP (None: its default policy)."""
        return {"auto": None, "true": True, "false": False}[self.reshard_after_forward]

    def dims(self, world_size: int) -> ParallelDims | None:
        """The mesh these degrees make on ``world_size`` ranks (a -1 inferred); None when they do not fit."""
        _, problems = check_degrees(world_size, **self.degrees)
        return None if problems else ParallelDims(world_size=world_size, **self.degrees)

    def problems(self, world_size: int, *, experts: int | None = None) -> list[str]:
        """Every problem with these settings on ``world_size`` ranks (the model's own limits, e.g. heads
        over tp, are the trainer's to add; ``experts``: a mixture's expert count, for the ep degrees named)."""
        _, out = check_degrees(world_size, experts=experts, **self.degrees)
        dims = self.dims(world_size)
        if dims is None:
            return out
        out += self.pipeline_flag_problems(dims)
        out += strategy_problems(self.strategy, dims, offload_optimizer=self.offload_optimizer, spell=FLAGS)
        out += compile_problems(self.compile, dims, spell=FLAGS)
        out += ac_problems(self.ac, dims, schedule=self.pipeline_schedule, spell=FLAGS)
        out += float8_problems(self.float8, tp=dims.tp, dtype=self.dtype, strategy=self.strategy, spell=FLAGS)
        return out

    def pipeline_flag_problems(self, dims: ParallelDims) -> list[str]:
        """Settings that only a pipeline or only FSDP can honour, given without one: refused, never ignored."""
        out = []
        if dims.pp == 1:
            given = [
                flag
                for flag, value in (("--pp-schedule", self.pp_schedule), ("--split-points", self.split_points))
                if value is not None
            ]
            given += ["--stages-per-rank"] if self.stages_per_rank != 1 else []
            if given:
                out.append(only_with(given, "with --pp > 1 (got pp=1)", "add --pp N"))
        if self.cp_attention != "ring" and dims.cp == 1:
            out.append(only_with([f"--cp-attention {self.cp_attention}"], "with --cp > 1 (got cp=1)", "add --cp N"))
        if self.reshard_after_forward != "auto" and not shards_parameters(dims, self.strategy):
            out.append(
                f"--reshard-after-forward {self.reshard_after_forward} is an FSDP option; --strategy "
                f"{self.strategy} with dp={dims.dp}, cp={dims.cp} does not shard parameters (use --strategy fsdp "
                "over dp or cp > 1, or drop the flag)"
            )
        return out


@dataclass
class RunConfig:
    """How to run: the seed, the output folder and what goes there, trackers, checkpoints, failures."""

    seed: int = option(0, "--seed", parse=random_seed, group="training", help="seed of weights and data")
    outdir: str | None = option(
        None, "--outdir", metavar="DIR", shown="outputs/{example}/<UTC timestamp>", group="output", help="output folder"
    )
    log_every: int = option(1, "--log-every", parse=positive_int, group="output", help="print every N steps")
    warmup: int = option(
        2, "--warmup", parse=nonnegative_int, group="output", help="steps excluded from timing statistics"
    )
    no_plots: bool = option(False, "--no-plots", group="output", help="skip text and image plots at the end")
    wandb: bool = option(
        False,
        "--wandb",
        group="tracking",
        help="log every history row to Weights & Biases, the run under <outdir>/wandb (WANDB_MODE=offline: no "
        "network, `wandb sync` it later); needs pip install 'mmm[wandb]'",
    )
    wandb_project: str | None = option(
        None, "--wandb-project", metavar="NAME", shown="WANDB_PROJECT or mmm", group="tracking", help="W&B project"
    )
    wandb_name: str | None = option(
        None, "--wandb-name", metavar="NAME", shown="WANDB_NAME or W&B's own", group="tracking", help="W&B run name"
    )
    tensorboard: bool = option(
        False,
        "--tensorboard",
        group="tracking",
        help="write TensorBoard event files to <outdir>/tensorboard, a scalar per history key; needs pip install "
        "'mmm[tensorboard]'",
    )
    rank_timings: bool = option(
        False,
        "--rank-timings",
        group="tracking",
        help="on logging steps, gather every rank's dt (one small all-gather over all ranks): dt_min, dt_max, "
        "dt_mean, slowest_rank and dt_lag in the history, so a straggler shows",
    )
    checkpoint_dir: str | None = option(
        None,
        "--checkpoint-dir",
        metavar="DIR",
        shown="off",
        group="checkpoint",
        help="save checkpoints here (step-NNNNNNNN/ folders, each complete or absent)",
    )
    checkpoint_every: int = option(
        0,
        "--checkpoint-every",
        parse=nonnegative_int,
        group="checkpoint",
        help="save every N steps; the last step and SIGTERM always save",
    )
    resume: str | None = option(
        None,
        "--resume",
        const="latest",
        metavar="latest|STEP",
        group="checkpoint",
        help="continue from the latest checkpoint in --checkpoint-dir (a fresh start when there is none yet; a "
        "bare --resume means latest) or from a given step; the mesh may differ from the one that saved it",
    )
    start_over: bool = option(
        False,
        "--start-over",
        group="checkpoint",
        help="start at step 1 although --checkpoint-dir or --outdir hold an earlier run (refused otherwise): "
        "that run's folder is moved aside to <folder>.old-<UTC time>, nothing is deleted",
    )
    keep_last: int = option(
        0,
        "--keep-last",
        parse=nonnegative_int,
        metavar="K",
        group="checkpoint",
        help="keep only the K newest checkpoints; 0 keeps all",
    )
    checkpoint_async: bool = option(
        False,
        "--checkpoint-async",
        group="checkpoint",
        help="write checkpoints in the background: a save holds training up only while this rank's state is "
        "copied to host memory; one save in flight at a time, the last step and SIGTERM wait for theirs "
        "(torch strategies; needs --checkpoint-dir)",
    )
    timeout: float | None = option(
        None,
        "--timeout",
        parse=seconds,
        metavar="SECONDS",
        shown="MMM_TIMEOUT or 600",
        group="failures",
        help="collective timeout: a rank that stalls this long makes the others fail with a clear message",
    )
    on_nonfinite: str = option(
        "stop",
        "--on-nonfinite",
        choices=("stop", "skip"),
        group="failures",
        help="a NaN/inf loss or gradient norm: stop with an error naming the step (the last checkpoint stays the "
        "last good one), or skip that step's update (torch strategies)",
    )

    @property
    def trackers(self) -> list[str]:
        """The trackers asked for, in a fixed order."""
        return [name for name in EXTRAS if getattr(self, name)]

    def problems(self, *, strategy: str = "fsdp") -> list[str]:
        """Every problem with these settings (a tracker whose package does not import is one: checked
        on every rank, so every rank stops alike)."""
        out = flag_problems(self)
        out += checkpoint_problems(self.checkpoint_dir, self.resume, self.checkpoint_every, self.keep_last, spell=FLAGS)
        out += tracker_problems(self.trackers)
        for flag, value in (("--wandb-project", self.wandb_project), ("--wandb-name", self.wandb_name)):
            if value is not None and not self.wandb:
                out.append(only_with([flag], "with --wandb", "add --wandb"))
        if self.start_over and self.resume is not None:
            out.append(f"--start-over and --resume {self.resume} contradict each other; choose one")
        if self.timeout is not None and not self.timeout > 0:
            out.append(f"--timeout {self.timeout:g} must be a positive number of seconds")
        if self.checkpoint_async and self.checkpoint_dir is None:
            out.append("--checkpoint-async needs --checkpoint-dir (the folder to save in); add one or drop the flag")
        if self.checkpoint_async and strategy.startswith("zero"):
            out.append(
                f"--checkpoint-async needs a torch strategy (ddp, fsdp, hsdp), not {strategy}: DeepSpeed saves with "
                "its own save_checkpoint, synchronously; drop --checkpoint-async"
            )
        if self.on_nonfinite == "skip" and strategy.startswith("zero"):
            out.append(
                f"--on-nonfinite skip needs a torch strategy (ddp, fsdp, hsdp), not {strategy}: DeepSpeed "
                "must step after every backward; use --on-nonfinite stop"
            )
        return out


@dataclass
class Config(Generic[T]):
    """A trainer's whole configuration: ``train`` (its recipe's own class), ``parallel``, ``run``; and
    ``recipe``, the :class:`mmm.training.recipe.Recipe` it configures (set by the recipe's command
    line), so that whoever is handed a config (the trainer, the planner) knows the model it is for."""

    train: T
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)
    recipe: Any = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """Every field, flat, by its name (the flags' names): what trackers record as the run's config. The
        held-out batches are the number an evaluation runs (``--eval-iters`` or its default)."""
        train = asdict(self.train)
        if getattr(self.train, "eval_every", 0):
            train["eval_iters"] = self.train.eval_batches
        return {**train, **asdict(self.parallel), **asdict(self.run)}


def trainer_flags(
    example: str,
    doc: str,
    train: type,
    *,
    parallel: Collection[str] | None = None,
    run: type[RunConfig] = RunConfig,
    titles: Mapping[str, str] | None = None,
    recipe: Any = None,
    prog: str | None = None,
    why_not: Mapping[str, str] | None = None,
) -> Flags:
    """The command line of ``python -m mmm.examples.<example>`` (``doc``: its docstring): every field
    of its ``train`` class and of ``run``, and the ``parallel`` fields of :class:`ParallelConfig` it
    offers (all when None; the others keep their defaults, and one given is refused with ``why_not``'s
    reason for it). ``.parse(argv)`` gives a :class:`Config`."""
    return Flags(
        prog=prog or f"python -m mmm.examples.{example}",
        doc=doc,
        sections={"train": (train, None), "parallel": (ParallelConfig, parallel), "run": (run, None)},
        into=partial(Config, recipe=recipe),
        example=example,
        titles=titles,
        why_not=why_not,
    )
