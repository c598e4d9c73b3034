"""What differs between models: a :class:`Recipe`. One trainer (:mod:`mmm.training.trainer`) does
everything else, for every recipe.

A recipe names its config class (the "what to train" flags), builds its model on ``meta`` from
that config, says how the model is parallelised (its :class:`~mmm.parallel.ParallelSpec`: TP plan
and blocks), its loss, its FLOPs per unit of work, its own checks, and how a run goes through its
data (:meth:`Recipe.loop`: batches, learning rate, evaluation, what checkpoints and the summary
record). mmm's recipes live beside their models (``mmm.models.llama.recipe:LLAMA``,
``mmm.models.vit.recipe:VIT``, ``mmm.models.cnn.recipe:DIGITS``); a user's recipe lives wherever the
user likes, and commands find any of them by a dotted ``module:NAME`` (:func:`load_recipe`).

A recipe module sits in the training layer (it uses the configs, the data and the checkpoints), even
beside its model: nothing in ``mmm.models`` imports it (``tests/test_code.py`` holds that).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from mmm.cli import flag_fields, nonempty_text
from mmm.errors import UsageError
from mmm.parallel.compose import ParallelSpec
from mmm.parallel.meta import count_params
from mmm.parallel.optim import adamw
from mmm.parallel.strategy import ZERO_STAGES, Engine, build_engine
from mmm.training.config import Config, ParallelConfig, RunConfig, trainer_flags
from mmm.training.evaluation import EvalConfig
from mmm.training.schedule import ScheduleConfig

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Context:
    """What a run has made by the time the recipe's loop is asked for (:meth:`Recipe.loop`); ``run``
    (the :class:`~mmm.training.recorder.Recorder`) and ``start`` are filled in before the first step."""

    config: Config
    model_config: Any
    mesh: Any
    engine: Engine
    info: Any
    outdir: Any
    log: Any
    num_params: int
    run: Any = None
    start: int = 1

    @property
    def device(self) -> torch.device:
        return self.info.device


@dataclass(frozen=True)
class Shape:
    """What the planner reads of a model's shape, besides what it builds: ``blocks``, the repeated blocks
    (pipeline stages, activation checkpointing and FSDP units; 0: none); for a sequence model
    ``seq_len``, and its attention's ``heads``, ``kv_heads`` and ``head_dim`` (context parallel's ring)."""

    blocks: int = 0
    seq_len: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0


@dataclass
class Loop:
    """How a run of a recipe goes through its steps (what :func:`mmm.training.loop.fit` is handed).

    - ``last_step``: the run's last step (steps are 1, 2, ..., ``last_step``);
    - ``lr_at(step)``: the step's learning rate;
    - ``batch(step)``: this rank's (inputs, targets) of the step's global batch, from ``ctx.start`` on;
    - ``evaluate(step, last)``: values recorded with the step (``{}`` when none is due);
    - ``after_update(step)``: after the optimizer step, within the step's time and before its
      checkpoint; values recorded with the step;
    - ``after_step(step)``: runs once the step is recorded and saved;
    - ``meta``: what a checkpoint records beyond the common fields (a resume must match it);
      ``extra_at(step)``: what each checkpoint records of its step;
    - ``finish()``: after the last step (exports, a saved model); returns what ``summary.json`` adds.
    """

    last_step: int
    lr_at: Callable[[int], float]
    batch: Callable[[int], Batch]
    evaluate: Callable[[int, bool], dict[str, float]] | None = None
    after_update: Callable[[int], dict] | None = None
    after_step: Callable[[int], None] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra_at: Callable[[int], dict[str, Any]] | None = None
    finish: Callable[[], dict[str, Any]] | None = None


class Recipe:
    """What differs between models; subclass it and make one instance (found as ``module:NAME``).

    Class attributes: ``name`` (``outputs/<name>/``, ``python -m mmm.examples.<name>``), ``config``
    (the dataclass of the "what to train" flags, with ``batch_size`` (the global batch) and
    ``lr``), ``run_config`` (its :class:`RunConfig`), ``parallel_flags`` (the
    :class:`ParallelConfig` fields on its command line; None: all), ``titles`` (--help's section
    titles), ``rate`` (the throughput's name in History: ``tps`` or ``samples_per_s``), ``run_only`` (the
    fields of ``config`` that decide how long a run goes, what it writes or reads back, not what one step
    holds or sends: the planner says it leaves them; the schedule's and evaluation's are so already).

    Methods to write: :meth:`build`, :meth:`spec`, :meth:`loss`, :meth:`problems`, :meth:`loop`, and for
    the planner and mmm.verify :meth:`example_batch` (with :meth:`shape` and :meth:`with_blocks` for a
    model of repeated blocks); the others have defaults.
    """

    name: str = ""
    config: type = object
    run_config: type[RunConfig] = RunConfig
    parallel_flags: tuple[str, ...] | None = None
    titles: Mapping[str, str] = {}
    rate: str = "samples_per_s"
    run_only: frozenset[str] = frozenset()

    def run_only_fields(self) -> frozenset[str]:
        """``run_only`` and the fields every trainer's run has that shape no step: the learning-rate
        schedule's, the evaluation's, ``max_iters``."""
        common = {f.name for cls in (ScheduleConfig, EvalConfig) for f in fields(cls)} | {"max_iters"}
        return frozenset(common) | self.run_only

    # --- the command line and its checks
    def command_line(self, doc: str = "", prog: str | None = None):
        """The trainer's flags (``doc``: its --help text; ``prog``: its command, by default
        ``python -m mmm.examples.<name>``); ``.parse(argv)`` gives a :class:`Config`."""
        return trainer_flags(
            self.name,
            doc,
            self.config,
            parallel=self.parallel_flags,
            run=self.run_config,
            titles=self.titles,
            recipe=self,
            prog=prog,
            why_not={
                f.name: self.not_offered(f.name)
                for f in flag_fields(ParallelConfig)
                if self.parallel_flags is not None and f.name not in self.parallel_flags
            },
        )

    def not_offered(self, field: str) -> str:
        """Why this recipe's command line has no flag for :class:`ParallelConfig` ``field`` (it is not in
        ``parallel_flags``): said when a user gives it (mmm's Llama takes every one)."""
        return f"the {self.name} recipe does not offer it (python -m mmm.examples.fsdp_tp, mmm's Llama, takes it)"

    def problems(self, config: Config, world_size: int) -> list[str]:
        """Every problem with ``config`` on ``world_size`` ranks, at once (each names the value and the fix)."""
        raise NotImplementedError

    def picks_layout(self, config: Config) -> bool:
        """True when the run asks the planner for its layout (its layout's checks then wait for the pick)."""
        return False

    def layout_free_problems(self, config: Config, world_size: int) -> list[str]:
        """The problems of :meth:`problems` that do not depend on the layout (checked at the start of a run
        whose layout is still to be picked)."""
        return self.problems(config, world_size)

    def layout_problems(self, config: Config, world_size: int) -> list[str]:
        """The rest of :meth:`problems`: those of the layout (checked once the layout is picked)."""
        return self.problems(config, world_size)

    # --- the model
    def model_config(self, train) -> Any:
        """The model's shape from the train config (``train.model_config()`` by default)."""
        return train.model_config()

    def build(self, model_config) -> nn.Module:
        """The plain single-device model (called under :func:`mmm.parallel.meta_init`)."""
        raise NotImplementedError

    def param_count(self, model_config) -> int:
        """The model's parameters, known before it is built (the trainer sizes host memory's handling by
        them): by default counted on a build on meta; a recipe that knows the closed form says it."""
        return count_params(lambda: self.build(model_config))

    def spec(self, how: ParallelConfig, model_config) -> ParallelSpec:
        """How the model is parallelised: its TP plan, blocks, AC, compile, dtype (the strategy is the flag's)."""
        raise NotImplementedError

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def flops_per_unit(self, model_config) -> float | None:
        """Training FLOPs per unit of ``rate`` (token, sample), for MFU; None: MFU is not reported."""
        return None

    def per_step(self, train, model_config) -> int:
        """Units of ``rate`` in one step's global batch: samples (``train.batch_size``) by default."""
        return train.batch_size

    # --- what the planner needs besides (mmm.plan: a rank simulated on fake tensors)
    def example_batch(self, model_config, *, rows: int, cp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of ``rows`` sequences or samples, as a rank's batch is shaped (its 1/``cp`` of
        each sequence under context parallel); their values do not matter (zeros)."""
        raise UsageError(
            f"recipe {self.name!r} has no example_batch: the planner and mmm.verify need a rank's batch shapes "
            "(write Recipe.example_batch)"
        )

    def shape(self, model_config) -> Shape:
        """The model's blocks and, for a sequence model, its attention's shape (:class:`Shape`)."""
        return Shape()

    def with_blocks(self, model_config, blocks: int):
        """``model_config`` with ``blocks`` repeated blocks (the planner simulates a few and carries on)."""
        raise UsageError(
            f"recipe {self.name!r} has blocks (Recipe.shape) but no with_blocks: the planner needs a model of "
            "fewer blocks (write Recipe.with_blocks)"
        )

    def experts(self, model_config) -> int:
        """Routed experts per block of the model (0: none); the planner ranks ep degrees that split them."""
        return 0

    def estimate(self, config: Config, world: int) -> tuple[dict[str, float], dict[str, float]] | None:
        """Closed-form per-rank (memory bytes, communication bytes by group) of ``config`` on ``world``
        ranks, for ``python -m mmm.plan``; None: the recipe has no such model (the simulator has)."""
        return None

    def not_estimated(self, config: Config) -> str | None:
        """What of ``config`` the closed form of :meth:`estimate` does not model (its estimate is then None,
        and ``python -m mmm.plan`` says why); None: nothing, or the recipe has no closed form at all."""
        return None

    def prepare(self, model: nn.Module, mesh, model_config, how) -> None:
        """Before the model is parallelised (e.g. context parallel's attention swapped in); ``how``: the
        :class:`~mmm.training.config.ParallelConfig`."""

    def loaded(self, engine: Engine, config: Config, log) -> None:
        """After the engine is built, before the first step (e.g. weights read from a checkpoint)."""

    def measure_step(self, config: Config) -> int | None:
        """The step ``--measure`` watches (communication per mesh axis, saved activations); None: none."""
        return None

    def describe(self, model_config) -> str:
        """The model's line in the log."""
        return f"model: {model_config}"

    def summary(self, model_config) -> dict[str, Any]:
        """The model's entry of ``summary.json`` and of a checkpoint's record (a resume must match it)."""
        return dict(vars(model_config))

    # --- the optimizer and the engine
    def optimizer_args(self, train) -> dict[str, Any]:
        """AdamW's arguments (torch's AdamW, or DeepSpeed's under ZeRO)."""
        return {"lr": train.lr}

    def max_grad_norm(self, train) -> float:
        """Clip the global gradient norm to this (0: no clipping)."""
        return 0.0

    def make_engine(
        self, model: nn.Module, mesh, config: Config, *, device, spec: ParallelSpec | None = None
    ) -> Engine:
        """``model`` (on meta) over ``mesh``: :meth:`spec` (or ``spec``), the strategy, AdamW, clipping and
        the pipeline as the flags say; shards materialised on ``device`` (``meta`` keeps them there)."""
        what, how = config.train, config.parallel
        if spec is None:
            spec = self.spec(how, self.model_config(what))
        args = self.optimizer_args(what)
        return build_engine(
            model,
            mesh,
            spec,
            strategy=how.strategy,
            device=device,
            max_grad_norm=self.max_grad_norm(what),
            # DeepSpeed flattens the parameters it is given into its own partitions: torch's plain AdamW there
            make_optimizer=(lambda params: torch.optim.AdamW(params, **args))
            if how.strategy in ZERO_STAGES
            else (lambda params: adamw(params, **args)),
            global_batch=what.batch_size,
            optimizer_args=args,
            offload_optimizer=how.offload_optimizer,
            seed=config.run.seed,
            microbatches=how.microbatches,  # a pipeline's, or without one gradient accumulation
            pipeline_args=dict(  # used under pp > 1 only
                loss_fn=self.loss,
                schedule=how.pipeline_schedule,
                stages_per_rank=how.stages_per_rank,
                split_points=how.split_points,
            ),
        )

    # --- the run
    def loop(self, ctx: Context) -> Loop:
        """How this run goes through its data (see :class:`Loop`)."""
        raise NotImplementedError


def load_recipe(spec: str) -> Recipe:
    """The recipe a command names: ``module:NAME`` (``mmm.models.llama.recipe:LLAMA``, ``mypkg.train:MINE``)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise UsageError(f"recipe {spec!r}: give module:NAME, e.g. mmm.models.llama.recipe:LLAMA")
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            raise UsageError(f"recipe {spec!r}: no module {e.name!r} (is it on PYTHONPATH?)") from None
        raise UsageError(f"recipe {spec!r}: importing {module} needs {e.name!r}, which is not installed") from None
    except ImportError as e:
        raise UsageError(f"recipe {spec!r}: cannot import {module}: {e}") from None
    if not hasattr(loaded, attr):
        raise UsageError(f"recipe {spec!r}: {module} has no {attr!r}")
    found = getattr(loaded, attr)
    if not isinstance(found, Recipe):
        hint = (
            " (a function that builds your model is enough for python -m mmm.verify --model; the trainer and "
            "the planner take a Recipe: examples/own_recipe.py, docs/trainers.md)"
            if callable(found)
            else ""
        )
        raise UsageError(f"recipe {spec!r} is a {type(found).__name__}, not an mmm.training.recipe.Recipe{hint}")
    return found


# the recipe a command takes when none is named (--recipe): the fsdp_tp trainer's
DEFAULT_RECIPE = "mmm.models.llama.recipe:LLAMA"
RECIPES = {  # short names for --recipe (any module:NAME works too)
    "llama": DEFAULT_RECIPE,
    "vit": "mmm.models.vit.recipe:VIT",
    "cnn": "mmm.models.cnn.recipe:DIGITS",
    "hf": "mmm.models.hf.recipe:HF_CAUSAL_LM",
}


RECIPE_HELP = (
    "the model: llama (mmm's, the fsdp_tp trainer's; the default), vit, cnn, hf (any transformers "
    "causal LM from its config.json: --hf-config PATH), or module:NAME (a recipe of your own, "
    "mmm.training.recipe.Recipe); the model's flags are the recipe's"
)


def recipe_from_argv(argv: Sequence[str]) -> tuple[Recipe, list[str]]:
    """The recipe ``--recipe NAME`` names in ``argv`` (None given: Llama's), and ``argv`` without it: a
    command's other flags are the recipe's, so it is found before they are parsed."""
    name, rest = split_recipe_flag(argv)
    return recipe_named(name), rest


def split_recipe_flag(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--recipe``'s value as given (None: not given) and the other arguments."""
    argv, name, rest = list(argv), None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--recipe":
            if i + 1 >= len(argv):
                raise UsageError(f"--recipe needs a value: {RECIPE_HELP}")
            name, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--recipe="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def add_recipe_flag(parser) -> None:
    """``--recipe`` in a command's --help (it is read before the parser: :func:`recipe_from_argv`)."""
    parser.add_argument_group("model recipe").add_argument(
        "--recipe", type=nonempty_text, metavar="NAME", help=RECIPE_HELP
    )


def recipe_named(name: str | None) -> Recipe:
    """The recipe ``--recipe`` names: a short name of :data:`RECIPES` or ``module:NAME`` (None: Llama's)."""
    name = name or "llama"
    if name not in RECIPES and ":" not in name:
        raise UsageError(f"--recipe {name!r}: give one of {', '.join(RECIPES)} or module:NAME (your own recipe)")
    return load_recipe(RECIPES.get(name, name))
