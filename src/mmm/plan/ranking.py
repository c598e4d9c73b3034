"""Every valid fsdp/hsdp layout of a job simulated (:mod:`mmm.plan.fake`) and predicted on the hardware,
ranked by step time within the memory; those that cannot win left out by their floor
(:mod:`mmm.plan.floor`). ``python -m mmm.plan.simulate --pick``."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from mmm.errors import UsageError
from mmm.log import get_logger
from mmm.plan import Combo, plan
from mmm.plan.fake import RankReport, setup_lines_left_out, simulate_by_blocks
from mmm.plan.floor import block_params, layout_floor, state_floor, trial_config
from mmm.plan.hardware import Hardware
from mmm.plan.predict import MEMORY_MARGIN, pipeline_bubble
from mmm.training.config import Config


@dataclass
class Ranked:
    """A layout and its simulated ranks, ranked by :func:`rank_layouts`."""

    combo: Combo
    reports: list[RankReport]
    ac: str | None = None
    """The activation checkpointing the pick chose for this layout where not the config's (None: the config's)."""

    @property
    def label(self) -> str:
        return self.combo.label + (f"-ac{self.ac}" if self.ac else "")

    @property
    def flags(self) -> list[str]:
        return [*self.combo.flags, *(["--ac", self.ac] if self.ac else [])]

    @property
    def step_s(self) -> float:
        return max(r.prediction["step_s"] for r in self.reports)

    @property
    def fits(self) -> bool:
        return all(r.prediction["fits"] for r in self.reports)

    def why(self) -> str:
        """The slowest rank's step time, split into its parts."""
        p = max((r.prediction for r in self.reports), key=lambda p: p["step_s"])
        parts = [f"compute {p['compute_s'] * 1e3:.1f} ms"]
        if p["memory_s"]:
            parts[0] += f" (memory-bound ops {p['memory_s'] * 1e3:.1f})"
        if p["bubble_s"]:
            parts.append(f"pipeline bubble {p['bubble_s'] * 1e3:.1f} ms")
        parts += [
            f"{axis} {t * 1e3:.1f} ms{' across nodes' if p['crosses_nodes'][axis] else ''}"
            for axis, t in p["exposed_s"].items()
            if t >= 0.005 * p["step_s"]
        ]
        peak = max(r.prediction["peak_bytes"] for r in self.reports)
        accumulated = self.combo.microbatches if self.combo.degrees["pp"] == 1 else None
        held = f" ({accumulated} microbatches accumulated)" if accumulated else ""
        return f"{' + '.join(parts)}; peak {peak / 2**30:.2f} of {p['memory_bytes'] / 2**30:.0f} GiB{held}"


PARALLEL_AFTER_S = 10.0
"""When the other layouts, at the pace of the first (the cheapest), would take longer than this to
simulate one after another, they are simulated at once (a process starts in ~2 s)."""


def _usable_cores() -> int:
    """The cores this process may use that other work leaves idle: its affinity, less the machine's load
    (the last minute's run queue, this process counted as one of its own). On a busy machine more
    processes would only add their start (each imports torch: seconds of CPU) to the same cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] - 1
    except OSError:  # no load average here
        return cores
    return max(1, min(cores, math.floor(cores - busy + 0.5)))


# activation checkpointing, least recomputation first: --pick without --ac takes the first that fits (or,
# with gradient accumulation tried too, the fastest that fits of each AC's)
AC_ORDER = ("none", "selective", "full")
# a pipeline's microbatches per stage that --pick without --microbatches ranks (1: the trainer's default)
MICROBATCHES_PER_STAGE = (1, 2, 4)
# variants with more microbatches of pipelines left out by their floor that --pick simulates, at most
REVIVED_AT_MOST = 4


def _microbatch_variants(config: Config, world: int, combo: Combo) -> list[Combo]:
    """``combo``, and under a pipeline the same layout with more microbatches (:data:`MICROBATCHES_PER_STAGE`)
    where the trainer accepts them (the per-dp-rank batch splits so, the schedule takes them)."""
    pp = combo.degrees["pp"]
    out = [combo]
    for per_stage in MICROBATCHES_PER_STAGE[1:] if pp > 1 else ():
        variant = replace(combo, microbatches=per_stage * pp)
        if not config.recipe.problems(trial_config(config, variant), world):
            out.append(variant)
    return out


def _accumulation_variants(config: Config, world: int, combo: Combo) -> list[Combo]:
    """Without a pipeline, ``combo`` with each count of gradient accumulation's microbatches the trainer takes
    (dividing the per-dp-rank batch; a recipe whose trainer offers no --microbatches: none), the fewest
    first: what the step holds at once falls with each; the global batch, and so the numerics, stay."""
    d = combo.degrees
    batch = getattr(config.train, "batch_size", None)
    offered = getattr(config.recipe, "parallel_flags", None)
    if d["pp"] > 1 or combo.microbatches or not isinstance(batch, int):
        return []
    if offered is not None and "microbatches" not in offered:
        return []
    per_rank = batch // max(1, world // (d["cp"] * d["tp"]))
    out = []
    for parts in range(2, per_rank + 1):
        variant = replace(combo, microbatches=parts)
        if per_rank % parts == 0 and not config.recipe.problems(trial_config(config, variant), world):
            out.append(variant)
    return out


def _parts_to_fit(reports: list[RankReport], variants: list[Combo], usable: float) -> list[Combo]:
    """Of ``variants`` (:func:`_accumulation_variants`), those with enough microbatches for the peak of the
    step ``reports`` simulated to fit in ``usable`` bytes, the fewest first. What each rank held before the
    step stays; the rest of its peak (saved activations, the backward's transients) taken as divided among
    the microbatches: a bound that the fewest counts it leaves may still miss (gradients do not divide)."""
    need = 1.0
    for r in reports:
        held = r.step["peak"]["before_step"]
        if held >= usable:
            return []  # not even what the step starts with fits
        need = max(need, (r.prediction["peak_bytes"] - held) / (usable - held))
    return [v for v in variants if v.microbatches >= need]


def _simulate_layout(task) -> tuple[list[RankReport] | None, str | None, str | None, int | None]:
    """One layout of :func:`rank_layouts`: its reports, or why the simulator refused it; the activation
    checkpointing chosen (the first of ``acs`` whose peak fits; None: ``config``'s); and gradient
    accumulation's microbatches chosen (None: none). With ``accumulate``, an AC whose step does not fit
    is also tried with the fewest microbatches that its peak says would fit (then the next count), and
    the pick is the fastest that fits of each AC's (an AC stops the search once its step without
    accumulation is no faster than the pick so far: more recomputation and more microbatches only add).
    A layout that fits in no trial is reported with its heaviest AC's step without accumulation. With ``stops`` (each
    AC's floor) and ``best``: no reports (nor reason) once the AC to try next has a floor no faster than
    ``best`` and nothing lighter fit (the layout cannot be the pick with that much recomputation or more)."""
    config, combo, world, per_node, hardware, acs, stops, best, expert_load, accumulate = task
    # rank 0 (FSDP's first shards are the largest when a dimension does not split evenly); under a
    # pipeline also the rank of the same coordinates in the last stage (rank 0's first step waits for
    # its shapes: it is simulated first, once)
    ranks = [0, world - world // combo.degrees["pp"]] if combo.degrees["pp"] > 1 else [0]
    variants = None  # gradient accumulation's, made at the first step that does not fit
    usable = (1 - MEMORY_MARGIN) * hardware.memory_bytes

    def simulated(variant: Combo, ac: str | None) -> list[RankReport]:
        trial = trial_config(config, variant, ac)
        with setup_lines_left_out():
            return simulate_by_blocks(
                trial, world=world, ranks=ranks, devices_per_node=per_node, hardware=hardware, expert_load=expert_load
            )

    def step_s(reports: list[RankReport]) -> float:
        return max(r.prediction["step_s"] for r in reports)

    def fits(reports: list[RankReport]) -> bool:
        return all(r.prediction["fits"] for r in reports)

    picked = last = None  # (reports, ac, microbatches); last: the last AC's step without accumulation
    for ac in acs or (None,):
        if stops and stops[ac] >= best:
            if picked is None:
                return None, None, ac, None
            break
        if acs and ac != acs[-1] and trial_config(config, combo, ac).parallel.problems(world):
            continue  # an AC this layout cannot run with (selective with ep at efsdp 1, or a zero-bubble pipeline)
        try:
            reports = simulated(combo, ac)
        except UsageError as e:
            if picked is not None:  # a lighter AC fit (with microbatches): the heavier one is not needed
                break
            return None, str(e), ac, None
        last = (reports, ac, None)
        if picked is not None and step_s(reports) >= step_s(picked[0]):
            break  # this AC and the heavier ones, with any microbatches, are no faster than the pick
        if fits(reports):  # the fastest of this AC; a heavier one is slower
            picked = last
            break
        if variants is None:
            variants = _accumulation_variants(config, world, combo) if accumulate else []
        for variant in _parts_to_fit(reports, variants, usable)[:2]:
            try:
                more = simulated(variant, ac)
            except UsageError:
                break  # the simulator refuses these microbatches (the layout itself it took)
            if fits(more):
                if picked is None or step_s(more) < step_s(picked[0]):
                    picked = (more, ac, variant.microbatches)
                break
    reports, ac, microbatches = picked or last
    return reports, None, (ac if ac != config.parallel.ac else None), microbatches


def end_with_parent(parent: int) -> None:
    """This process ends when ``parent`` does: a pool worker with the planner, the planner with the
    trainer rank that asked for a pick (:mod:`mmm.plan.pick`); none is left simulating for minutes
    on its own. Linux: the kernel's parent-death signal."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the planner ended before the signal was asked for
        print(
            f"mmm.plan.simulate: process {parent}, which started this one, has ended: nothing to plan for",
            file=sys.stderr,
        )
        os._exit(1)


def _simulate_layouts(
    combos,
    config,
    world: int,
    per_node: int,
    hardware,
    jobs: int | None,
    acs=None,
    stops=None,
    best=math.inf,
    expert_load: float = 1.0,
    accumulate: bool = False,
):
    """Each of ``combos`` simulated (:func:`_simulate_layout`), paired with its result (reports, refusal,
    AC chosen); the combo with gradient accumulation's microbatches where ``accumulate`` chose them.
    ``jobs``: processes at once (``None``: decided here, by how long the first, cheapest layout took).
    ``stops``: each layout's floor per activation checkpointing, by label; ``best``: the step to beat."""
    # the simulated step's ops grow with the ring attention's steps and the pipeline's stages: the
    # cheapest layout first (it decides whether to use more processes), the rest longest first
    combos = sorted(combos, key=lambda c: c.degrees["cp"] * c.degrees["pp"])
    stops = stops or {}
    tasks = [
        (config, c, world, per_node, hardware, acs, stops.get(c.label), best, expert_load, accumulate) for c in combos
    ]
    first = []
    if jobs is None and tasks:  # the first layout here; the others at once if they take longer than starting processes
        t0 = time.perf_counter()
        first = [_simulate_layout(tasks[0])]
        jobs = _usable_cores() if (time.perf_counter() - t0) * (len(tasks) - 1) > PARALLEL_AFTER_S else 1
    rest = tasks[len(first) :][::-1]
    if min(jobs or 1, len(rest)) > 1:  # fresh interpreters: each simulation sets up a process group of its own
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            min(jobs, len(rest)), mp_context=spawn, initializer=end_with_parent, initargs=(os.getpid(),)
        ) as pool:
            results = list(pool.map(_simulate_layout, rest))
    else:
        results = [_simulate_layout(task) for task in rest]
    done = zip([t[1] for t in [*tasks[: len(first)], *rest]], first + results, strict=True)
    return [
        (replace(c, microbatches=mb) if mb else c, (reports, refused, ac)) for c, (reports, refused, ac, mb) in done
    ]


def rank_layouts(
    config: Config,
    world: int,
    hardware: Hardware,
    *,
    devices_per_node: int | None = None,
    fixed: dict[str, int] | None = None,
    strategies: Sequence[str] = ("fsdp", "hsdp"),
    jobs: int | None = None,
    every: bool = False,
    choose_ac: bool = False,
    choose_microbatches: bool = False,
    expert_load: float = 1.0,
) -> list[Ranked]:
    """Every valid layout of ``world`` ranks that the simulator runs (fsdp or hsdp), each simulated (its
    first and last pipeline stage, one step, :func:`mmm.plan.fake.simulate_by_blocks`) and predicted on
    ``hardware``; fastest first, the ones whose memory does not fit last. Layouts without a pipeline or
    context parallel are simulated first; a layout with either whose floor
    (:func:`mmm.plan.floor.layout_floor`) is no faster than the best of them is left out unsimulated (one
    log line): it cannot be the pick. ``fixed``: degrees to hold. ``jobs``: layouts simulated at once,
    each in a process of its own (1: one after another, in this process; None: in each batch, the
    layouts without a pipeline or CP and then the others, the first here and the rest on every core this
    process may use if, at its pace, they would take more than :data:`PARALLEL_AFTER_S`). ``every``:
    none left out by its floor. ``choose_ac``: each layout takes the first activation checkpointing of
    :data:`AC_ORDER` (none, selective, full) whose peak fits, rather than the one in ``config`` (its
    floor counts none: the lowest); with gradient accumulation tried too, the fastest that fits of each
    AC's. ``choose_microbatches``: a pipeline layout is also ranked with 2 and
    4 microbatches per stage (:data:`MICROBATCHES_PER_STAGE`; a smaller bubble, smaller microbatches)
    where the trainer takes them; and a layout without a pipeline whose step does not fit is also tried
    with gradient accumulation (:func:`_simulate_layout`: per AC, the fewest microbatches its peak says
    would fit; the fastest that fits wins; the global batch kept, where a smaller ``--batch-size`` would
    change the training). A mixture of experts is also ranked over its ep degrees (those that
    split its experts), routing by plan (``expert_load``: the first expert's tokens over the mean)."""
    per_node = devices_per_node or hardware.devices_per_node
    combos = [c for c in plan(world, config, strategies=list(strategies), fixed=fixed) if c.valid]
    if not combos:
        raise UsageError(f"no fsdp or hsdp layout of {world} ranks is valid for this model; see python -m mmm.plan")
    # a layout whose state alone cannot fit is not simulated: its rank's share of the blocks' parameters,
    # gradients and AdamW state (the embedding and output left out: a floor) against the usable memory
    usable = (1 - MEMORY_MARGIN) * hardware.memory_bytes
    in_blocks = block_params(config.recipe, config.recipe.model_config(config.train))
    held_floor = {c.label: state_floor(config, world, c, blocks=in_blocks) for c in combos}
    over = [c for c in combos if held_floor[c.label] > usable]
    if over:
        worst = min(over, key=lambda c: held_floor[c.label])
        get_logger().warning(
            "%d of %d layouts left out unsimulated: their parameters, gradients and AdamW state alone exceed "
            "%.0f GiB of %.0f per device (the closest, %s: %.1f GiB)",
            len(over),
            len(combos),
            usable / 2**30,
            hardware.memory_bytes / 2**30,
            worst.label,
            held_floor[worst.label] / 2**30,
        )
        combos = [c for c in combos if held_floor[c.label] <= usable]
        if not combos:
            raise UsageError(
                f"no layout of {world} ranks fits in {hardware.memory_bytes / 2**30:.0f} GiB per device: the model's "
                "state alone does not (more ranks, or a device with more memory)"
            )
    # layouts without a pipeline or context parallel first; then the others whose floor (known before
    # their step is simulated) does not already make them slower than the best of those
    acs = AC_ORDER if choose_ac else None
    plain = [c for c in combos if c.degrees["pp"] == 1 and c.degrees["cp"] == 1]
    acc = choose_microbatches  # gradient accumulation, for the layouts without a pipeline whose step does not fit
    done = _simulate_layouts(
        plain, config, world, per_node, hardware, jobs, acs, expert_load=expert_load, accumulate=acc
    )
    best = min((r.step_s for r in (Ranked(c, rep) for c, (rep, _, _) in done if rep) if r.fits), default=math.inf)
    floor_config = replace(config, parallel=replace(config.parallel, ac=AC_ORDER[0])) if choose_ac else config
    others = [c for c in combos if c not in plain]
    # a pipeline's variants with more microbatches (a smaller bubble), ranked once the pipeline is simulated
    variants = {c.label: _microbatch_variants(config, world, c)[1:] for c in others} if choose_microbatches else {}
    parts: dict = {}  # the rings and blocks the floors ran, by their shapes

    def floor(c: Combo, base: Config = floor_config) -> float:
        return layout_floor(base, world, c, hardware, per_node, below=best, cache=parts)

    floors = {c.label: floor(c) for c in others} if best < math.inf and not every else {}
    slower = [c for c in others if floors.get(c.label, 0.0) >= best]
    if slower:
        closest = min(slower, key=lambda c: floors[c.label])
        get_logger().info(
            "%d of %d layouts with a pipeline or context parallel not simulated: their floor (the matrix "
            "multiplies, the pipeline's bubble, the memory-bound ops of the ring attention or of a pipeline's "
            "blocks, the ring's messages; the closest, %s: %.1f ms) exceeds the best step without either (%.1f ms)",
            len(slower),
            len(others),
            closest.label,
            floors[closest.label] * 1e3,
            best * 1e3,
        )

    def stops_for(cs: list[Combo]) -> dict:
        """With AC chosen: each layout's floor per AC, to stop before the checkpointing it cannot win with."""
        if not (choose_ac and best < math.inf and not every):
            return {}
        with_ac = {ac: replace(config, parallel=replace(config.parallel, ac=ac)) for ac in AC_ORDER}
        return {c.label: {ac: floor(c, with_ac[ac]) for ac in AC_ORDER} for c in cs}

    # a pipeline left out by its floor may still win with more microbatches (a smaller bubble): those of
    # its variants whose own floor is under the best are simulated with the others
    # (the lowest floors first, at most REVIVED_AT_MOST: a floor counts no communication but the ring's,
    # and at Llama-3-8B's size 36 variants' are under the best: an hour of pipelines)
    floors |= {v.label: floor(v) for c in slower for v in variants.get(c.label, ())}
    revived = sorted(
        (v for c in slower for v in variants.get(c.label, ()) if floors[v.label] < best), key=lambda v: floors[v.label]
    )
    if len(revived) > REVIVED_AT_MOST and not every:
        get_logger().info(
            "%d variants with more microbatches of pipelines left out by their floor have their own floor under "
            "the best step: the %d lowest simulated (the lowest, %s: %.1f ms; --every simulates them all)",
            len(revived),
            REVIVED_AT_MOST,
            revived[0].label,
            floors[revived[0].label] * 1e3,
        )
        revived = revived[:REVIVED_AT_MOST]
    # jobs given or decided again: by the pace of this batch's own first layout and its own count
    left = [c for c in others if c not in slower] + revived
    more = _simulate_layouts(
        left, config, world, per_node, hardware, jobs, acs, stops_for(left), best, expert_load, acc
    )
    # then the pipelines' variants with more microbatches that could beat the best: the simulated step
    # less the bubble they save (the rest of the step does not fall with more microbatches), or, where
    # the step needed more activation checkpointing than the least (a variant's smaller microbatches
    # may fit with less), the variant's floor
    best = min([best, *(r.step_s for r in (Ranked(c, rep) for c, (rep, _, _) in more if rep) if r.fits)])
    tried = []
    for combo, (reports, _, ac) in more:
        if reports is None or not variants.get(combo.label):
            continue
        slowest = max((r.prediction for r in reports), key=lambda p: p["step_s"])
        least = not choose_ac or (ac or config.parallel.ac) == AC_ORDER[0]  # its AC: no lighter one to fit with
        for v in variants[combo.label]:
            bubble = pipeline_bubble(
                slowest["compute_s"],
                hardware,
                pp=v.degrees["pp"],
                microbatches=v.microbatches,
                stages_per_rank=config.parallel.stages_per_rank,
                ranks_per_node=min(world, per_node),
            )
            bound = slowest["step_s"] - (slowest["bubble_s"] - bubble) if least else floor(v)
            if every or bound < best:
                tried.append(v)
    if any(variants.values()):
        get_logger().info(
            "%d of %d pipeline layouts with more microbatches per stage simulated (the others: their floor, or "
            "their pipeline's simulated step less the bubble they save, is no faster than %.1f ms)",
            len(tried) + len(revived),
            sum(len(vs) for vs in variants.values()),
            best * 1e3,
        )
    more += _simulate_layouts(
        tried, config, world, per_node, hardware, jobs, acs, stops_for(tried), best, expert_load, acc
    )
    out, refused_by_reason, stopped = [], {}, []
    for combo, (reports, refused, ac) in [*done, *more]:
        if refused:  # refused once built (the planner's checks passed): out of the ranking, said why
            refused_by_reason.setdefault(refused, []).append(combo.label)
        elif reports is None:
            stopped.append(f"{combo.label} ({ac})")
        else:
            out.append(Ranked(combo, reports, ac))
    if stopped:
        get_logger().info(
            "%d layouts left out before the activation checkpointing they would need to fit: their floor with it "
            "is no faster than the best step found before them (%s)",
            len(stopped),
            ", ".join(stopped[:3]) + (", ..." if len(stopped) > 3 else ""),
        )
    for reason, labels in refused_by_reason.items():  # one line per reason
        get_logger().warning("%s left out of the ranking: %s", ", ".join(labels), reason)
    if not out:
        raise UsageError(f"none of the {len(combos)} layouts of {world} ranks could be simulated (see the warnings)")
    out.sort(key=lambda r: (not r.fits, r.step_s))
    return out


def format_ranking(ranked: list[Ranked], hardware: Hardware, top: int = 5) -> str:
    lines = [f"{len(ranked)} layouts simulated, ranked by predicted step time on {hardware.name}:"]
    best = ranked[0].step_s
    for i, r in enumerate(ranked[:top], 1):
        fit = "" if r.fits else "  DOES NOT FIT"
        lines.append(f"{i:>3}. {r.label:<36} {r.step_s * 1e3:9.1f} ms  {r.step_s / best:5.2f}x  {r.why()}{fit}")
    if len(ranked) > top:
        lines.append(f"     ... {len(ranked) - top} more (--json has them all)")
    pick = ranked[0]
    if pick.fits:
        lines.append(f"pick: {' '.join(pick.flags)}")
    else:
        lines.append(
            "pick: none; no layout fits in memory (more activation checkpointing, a smaller --batch-size, "
            "or more ranks)"
        )
    return "\n".join(lines)
