"""Plan a parallel layout: every (pp, dp_replicate, dp_shard, cp, tp, strategy) for N ranks, why
the invalid ones are invalid, and per-rank memory and communication estimates for the valid ones.

An application of the library (it asks the fsdp_tp trainer which layouts are valid). Used by
``python -m mmm.plan`` (:mod:`mmm.plan.cli`) and ``benchmarks/sweep.py``; usable as a function::

    from mmm.plan import plan
    for c in plan(8, dim=512, n_layers=8, seq_len=256, batch_size=32):
        print(c.label, c.valid and c.memory["total_bytes"], c.problems)

Validity is the recipe's own check (``recipe.problems``: the trainer's), so the planner and the
trainer never disagree. Estimates are the recipe's closed-form model (``recipe.estimate``), per rank
(the busiest rank where ranks differ): Llama's is :mod:`mmm.models.llama.estimate`. A recipe without
one gets its layouts checked, not estimated; ``python -m mmm.plan.simulate`` simulates any recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mmm.cli import flag_fields
from mmm.errors import UsageError
from mmm.parallel.experts import ep_degrees
from mmm.parallel.strategy import STRATEGIES
from mmm.training.config import Config, ParallelConfig
from mmm.training.recipe import Recipe, recipe_named

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class Combo:
    """One candidate layout; ``problems`` is empty when the trainer accepts it."""

    degrees: dict[str, int]
    strategy: str
    problems: list[str] = field(default_factory=list)
    memory: dict[str, float] | None = None
    comm: dict[str, float] | None = None
    microbatches: int | None = None
    """A pipeline's microbatches where the layout sets them (None: the command line's, or the default)."""

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def label(self) -> str:
        """``pp1-dpr1-dps2-cp1-tp2-fsdp``: a stable name, used for output folders (``-mb8``: 8 microbatches)."""
        short = {"pp": "pp", "dp_replicate": "dpr", "dp_shard": "dps", "cp": "cp", "tp": "tp"}
        mb = f"-mb{self.microbatches}" if self.microbatches else ""
        ep = f"-ep{self.degrees['ep']}" if self.degrees.get("ep", 1) > 1 else ""
        return "-".join(f"{short[a]}{self.degrees[a]}" for a in AXES) + f"{ep}-{self.strategy}{mb}"

    @property
    def flags(self) -> list[str]:
        """The trainer flags that select this layout: its degrees other than 1 (dp_shard is inferred from
        the rest), so that a recipe whose trainer has no flag for an axis it does not use takes them."""
        out = []
        for a in (*AXES, "ep"):
            if a != "dp_shard" and self.degrees.get(a, 1) != 1:
                out += [f"--{a.replace('_', '-')}", str(self.degrees[a])]
        mb = ["--microbatches", str(self.microbatches)] if self.microbatches else []
        return out + ["--strategy", self.strategy, *mb]

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            **self.degrees,
            "strategy": self.strategy,
            "valid": self.valid,
            "problems": self.problems,
            "memory": self.memory,
            "comm": self.comm,
        }


def _factorizations(n: int, parts: int):
    if parts == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _factorizations(n // d, parts - 1):
                yield (d, *rest)


def trainer_config(recipe: Recipe | None = None, **overrides) -> Config:
    """``recipe``'s defaults (None: the fsdp_tp trainer's Llama) with ``overrides`` (field names:
    ``n_layers=8``, ``dtype="bf16"``, ``measure=True``), each given to the config that has it."""
    recipe = recipe or recipe_named(None)
    sections = {"train": recipe.config, "parallel": ParallelConfig, "run": recipe.run_config}
    given: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in overrides.items():
        owner = next((name for name, cls in sections.items() if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"unknown trainer option {key}")
        given[owner][key] = value
    return Config(**{name: cls(**given[name]) for name, cls in sections.items()}, recipe=recipe)


def plan(
    world: int, config: Config | None = None, *, strategies=None, fixed: dict[str, int] | None = None, **overrides
) -> list[Combo]:
    """Every layout of ``world`` ranks (valid first, in mesh order), with estimates for the valid ones.

    ``config``: a recipe's (``config.recipe``; default: the Llama trainer's defaults with
    ``overrides``, see :func:`trainer_config`); its degrees and strategy are what varies.
    ``strategies``: the data-parallel strategies to consider (default all); ``fixed``: degrees to
    hold, e.g. ``{"tp": 2}``. A degree or strategy given as an override (``plan(4, tp=2)``,
    ``strategy="fsdp"``) is held too, as on the command line.
    """
    if not isinstance(world, int) or world < 1:
        raise UsageError(f"--world {world} must be a positive number of ranks (e.g. --world 4)")
    held = {k: overrides.pop(k) for k in (*AXES, "ep") if k in overrides}
    clash = {k: (v, fixed[k]) for k, v in held.items() if fixed and fixed.get(k) not in (None, v)}
    if clash:
        raise TypeError(f"plan(): {', '.join(f'{k}={a} and fixed[{k!r}]={b}' for k, (a, b) in clash.items())}")
    fixed = {**held, **(fixed or {})}
    if "strategy" in overrides:
        if strategies is not None:
            raise TypeError("plan(): give strategy= or strategies=, not both")
        strategies = [overrides.pop("strategy")]
    if config is not None and overrides:
        raise TypeError(f"plan(config=...): {', '.join(overrides)} would be ignored; set them in the config")
    config = config if config is not None else trainer_config(**overrides)
    recipe = config.recipe
    if recipe is None:
        raise TypeError("plan(config=...): a config made by a recipe's command line (its .recipe is set)")
    strategies = list(strategies or STRATEGIES)
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise UsageError(f"unknown strategy {', '.join(map(repr, bad))}; choose from: {', '.join(STRATEGIES)}")
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    out: list[Combo] = []
    try:
        experts = recipe.experts(recipe.model_config(config.train))
    except UsageError:  # the model's own problem: every layout says it
        experts = 0
    for shape in _factorizations(world, len(AXES)):
        for degrees in _with_ep(dict(zip(AXES, shape)), experts):
            if any(degrees.get(k, 1) != v for k, v in fixed.items()):
                continue
            out += _combos(config, world, degrees, strategies)
    out.sort(key=lambda c: not c.valid)
    if fixed and not out:
        ep = fixed.get("ep", 1)
        if ep > 1 and not experts:
            why = f"--ep {ep} splits a mixture of experts' experts; add --moe-experts N (a multiple of {ep})"
        elif ep > 1 and experts % ep:
            fits = [d for d in ep_degrees(experts, world) if d > 1][:3]
            why = f"--ep {ep} does not divide the {experts} experts; give an ep that divides them" + (
                f" (on {world} ranks: {', '.join(map(str, fits))})" if fits else ""
            )
        elif ep > 1:
            why = "ep borrows its ranks from dp_shard x cp, which it must divide, and the other degrees multiply to"
            why = f"no layout of {world} ranks has {', '.join(f'{k}={v}' for k, v in fixed.items())}: {why} {world}"
        else:
            why = (
                f"no layout of {world} ranks has {', '.join(f'{k}={v}' for k, v in fixed.items())}: "
                f"the degrees must multiply to {world}"
            )
        raise UsageError(why)
    return out


def _with_ep(degrees: dict[str, int], experts: int) -> list[dict[str, int]]:
    """``degrees``, and for a mixture of ``experts`` (> 0) once per ep that splits dp_shard x cp and the
    experts (an ``ep`` key then, 1 too)."""
    if not experts:
        return [degrees]
    room = degrees["dp_shard"] * degrees["cp"]
    return [{**degrees, "ep": e} for e in range(1, room + 1) if room % e == 0 and experts % e == 0]


def _combos(config: Config, world: int, degrees: dict[str, int], strategies) -> list[Combo]:
    """The layout of ``degrees`` with each strategy, checked by the recipe (and estimated where it can)."""
    out = []
    recipe = config.recipe
    for strategy in strategies:
        trial = replace(config, parallel=replace(config.parallel, **degrees, strategy=strategy))
        found = recipe.problems(trial, world)
        if not found and strategy == "ddp" and degrees["dp_replicate"] > 1:
            found = [
                f"same as dp_shard={degrees['dp_replicate'] * degrees['dp_shard']} with ddp: DDP "
                "replicates over the flattened dp group, so dp_replicate changes nothing"
            ]
        combo = Combo(degrees, strategy, found)
        estimates = recipe.estimate(trial, world) if combo.valid else None
        if estimates is not None:
            combo.memory, combo.comm = estimates
        out.append(combo)
    return out


def run_only_flags(config: Config) -> list[str]:
    """The trainer's flags given (not at their default) that neither the planner nor the simulator uses:
    said in a note, so a trainer's command line pasted here is welcome and nothing of it silently dropped."""
    given = []
    recipe = config.recipe or Recipe()  # a Config built in code may name none: the fields every run has
    for section, names in ((config.train, recipe.run_only_fields()), (config.run, None)):
        for f in flag_fields(type(section)):
            if (names is None or f.name in names) and getattr(section, f.name) != f.default:
                given.append(f.metadata["flags"][0])
    return given
