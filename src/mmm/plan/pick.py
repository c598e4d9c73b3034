"""The planner's pick for a job about to train: ``--pick-layout HARDWARE`` of a recipe's trainer.

Rank 0 hands the planner the trainer's typed config (:class:`PickRequest`) in a process of its own
(a fresh interpreter: a fake process group of the job's world, no launcher variables, so it never
takes itself for a rank of the job), which ranks the layouts as ``python -m mmm.plan.simulate
--pick`` does (:func:`mmm.plan.ranking.rank_layouts`) and hands back a typed :class:`Pick`; every
rank takes its layout; the trainer logs it with its reasons and writes it to summary.json
(``layout_pick``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from mmm.dist import without_launcher_vars
from mmm.errors import UsageError, first_line
from mmm.log import configure, get_logger
from mmm.plan.hardware import load_hardware
from mmm.plan.ranking import end_with_parent, rank_layouts
from mmm.training.config import Config
from mmm.training.recipe import Recipe

FLAG = "--pick-layout"
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class PickRequest:
    """What the trainer asks the planner: the layouts of ``world`` ranks for ``config`` (of
    ``config.recipe``) on ``hardware``, holding the degrees in ``held`` and the strategy if
    ``strategy_held``, choosing activation checkpointing and microbatches unless the run gave them."""

    config: Config
    world: int
    hardware: str
    devices_per_node: int | None = None
    held: dict[str, int] = field(default_factory=dict)
    strategy_held: bool = False
    choose_ac: bool = True
    choose_microbatches: bool = True


@dataclass
class Pick:
    """The planner's pick: its layout (``degrees``, ``strategy``; ``ac`` and ``microbatches`` where the
    planner chose them, else None), the trainer ``flags`` that select it, its predicted step and why,
    the best five ``ranked`` (label, step_s, fits, why), the ``layouts`` ranked and the planner's ``seconds``."""

    hardware: str
    label: str
    degrees: dict[str, int]
    strategy: str
    ac: str | None
    microbatches: int | None
    flags: list[str]
    predicted_step_s: float
    why: str
    ranked: list[dict]
    layouts: int
    seconds: float = 0.0


def rank_for(request: PickRequest) -> Pick:
    """The pick for ``request``, ranked in this process (:func:`planners_pick` runs it in a process of
    its own). A pick that cannot be made is a :class:`UsageError` naming ``--pick-layout``."""
    t0 = time.perf_counter()
    try:
        hw = load_hardware(request.hardware)
    except UsageError as e:
        raise UsageError(str(e).replace("--hardware", FLAG)) from None
    how = request.config.parallel
    strategies = [how.strategy] if request.strategy_held else ["fsdp", "hsdp"]
    if request.strategy_held and how.strategy not in ("fsdp", "hsdp"):
        raise UsageError(f"{FLAG}: --strategy {how.strategy} is not simulated; give fsdp or hsdp, or leave it out")
    try:
        ranked = rank_layouts(
            request.config,
            request.world,
            hw,
            devices_per_node=request.devices_per_node,
            fixed=request.held,
            strategies=strategies,
            choose_ac=request.choose_ac,
            choose_microbatches=request.choose_microbatches,
        )
    except UsageError as e:
        raise UsageError(f"{FLAG} {request.hardware}: {e}") from None
    best = ranked[0]
    if not best.fits:
        raise UsageError(
            f"{FLAG} {request.hardware}: no layout of {request.world} ranks fits in {hw.memory_bytes / 2**30:.0f} GiB "
            "per device (more activation checkpointing, a smaller --batch-size or more ranks)"
        )
    return Pick(
        hardware=hw.name,
        label=best.label,
        degrees=best.combo.degrees,
        strategy=best.combo.strategy,
        ac=best.ac,
        microbatches=best.combo.microbatches,
        flags=best.flags,
        predicted_step_s=best.step_s,
        why=best.why(),
        ranked=[{"label": r.label, "step_s": r.step_s, "fits": r.fits, "why": r.why()} for r in ranked[:5]],
        layouts=len(ranked),
        seconds=time.perf_counter() - t0,
    )


def _rank_in_child(request: PickRequest, out: str, log: str, parent: int) -> None:
    """The planner's process: no launcher variables (it is no rank of the job), its output to ``log``,
    ended with the rank that asked (``end_with_parent``); the pick, or the refusal, pickled to ``out``."""
    env = without_launcher_vars(dict(os.environ)) | {"MMM_LOG_LEVEL": "WARNING", "MMM_RICH": "0"}
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    end_with_parent(parent)
    configure()
    try:
        result: tuple = ("pick", rank_for(request))
    except UsageError as e:
        result = ("usage", str(e))
    except Exception as e:  # a bug: its traceback goes back to the trainer
        result = ("failed", f"{first_line(e)}\n{traceback.format_exc()}")
    with open(out, "wb") as f:
        pickle.dump(result, f)


def planners_pick(request: PickRequest) -> Pick:
    """:func:`rank_for` in a fresh process (spawned: no state of this rank's, no launcher variables)."""
    with tempfile.TemporaryDirectory(prefix="mmm-pick-") as tmp:
        out, log = Path(tmp) / "pick.pkl", Path(tmp) / "planner.log"
        child = multiprocessing.get_context("spawn").Process(
            target=_rank_in_child, args=(request, str(out), str(log), os.getpid()), name="mmm-planner"
        )
        child.start()
        child.join()
        if not out.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-20:] if log.exists() else []
            raise RuntimeError(f"{FLAG}: the planner failed (exit {child.exitcode}):\n" + "\n".join(tail))
        kind, found = pickle.loads(out.read_bytes())
    if kind == "usage":
        raise UsageError(found)
    if kind == "failed":
        raise RuntimeError(f"{FLAG}: the planner failed: {found}")
    return found


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def pick_request(config: Config, argv: list[str], info) -> PickRequest:
    """What this run asks the planner: its config and world; the mesh flags and --strategy it gave hold,
    and the --ac and --microbatches it gave."""
    how = config.parallel
    held = {a: how.degrees[a] for a in AXES if _given(argv, f"--{a.replace('_', '-')}")}
    aliases = {"tp": "--tpsize", "pp": "--ppsize", "cp": "--cpsize"}  # the original mmm's spellings
    held |= {a: how.degrees[a] for a, flag in aliases.items() if _given(argv, flag)}
    if _given(argv, "--ep"):  # expert parallel, held like the mesh's degrees
        held["ep"] = how.ep
    return PickRequest(
        config=config,
        world=info.world_size,
        hardware=config.train.pick_layout,
        devices_per_node=info.local_world_size,
        held=held,
        strategy_held=_given(argv, "--strategy"),
        choose_ac=not _given(argv, "--ac"),
        choose_microbatches=not _given(argv, "--microbatches"),
    )


def take_pick(recipe: Recipe, config: Config, argv: list[str], info) -> tuple[Config, dict]:
    """``--pick-layout`` for the one trainer (:func:`mmm.training.trainer.main`): rank 0 asks the planner,
    every rank takes its layout, which ``recipe``'s own checks then hold to."""
    found: list = [None]
    failure: BaseException | None = None
    if info.is_main:
        try:
            found = [planners_pick(pick_request(config, argv, info))]
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
    pick: Pick = found[0]
    # the planner's activation checkpointing and microbatches (a pipeline's, or gradient accumulation's), where
    # it chose them (given ones hold)
    chosen = {k: v for k, v in (("ac", pick.ac), ("microbatches", pick.microbatches)) if v}
    config = replace(config, parallel=replace(config.parallel, **pick.degrees, strategy=pick.strategy, **chosen))
    problems = recipe.layout_problems(config, info.world_size)  # the rest were checked at the start
    if problems:
        raise RuntimeError(f"the planner picked {pick.label}, which the trainer refuses: {'; '.join(problems)}")
    if info.is_main:
        log = get_logger()
        log.info(
            "layout: the planner picked %s of %d on %s in %.0f s: predicted step %.1f ms (%s)",
            pick.label,
            pick.layouts,
            pick.hardware,
            pick.seconds,
            pick.predicted_step_s * 1e3,
            pick.why,
        )
        for i, r in enumerate(pick.ranked[1:], 2):
            log.info("layout: #%d %s, predicted %.1f ms (%s)", i, r["label"], r["step_s"] * 1e3, r["why"])
    return config, asdict(pick)
