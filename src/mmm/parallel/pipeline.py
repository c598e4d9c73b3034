"""Pipeline parallelism: split a model along its blocks into stages, run a pipelining schedule.

Usable on your own model::

    from mmm.parallel.pipeline import split_model, stage_layer_ranges
    ranges = stage_layer_ranges(n_layers=8, num_stages=4)              # [(0, 2), (2, 4), ...]
    part = split_model(model, ranges[i], first=i == 0, last=i == 3)    # keeps only stage i's blocks

A model qualifies when its repeated blocks live in a ``ModuleDict`` (``layers`` by default),
its forward loops over that dict, and it skips the pre-block modules (embedding) and post-block
modules (norm, head) that are ``None``; :class:`mmm.models.llama.Llama` is written that way.
Block names stay those of the full model ("layers.5.attention.wq.weight"), so checkpoints of
a pipelined model load into the plain one.

Stages are placed the usual way: with p pipeline ranks and v stages per rank, rank r holds
stages r, r + p, ..., r + (v-1)p ("looped"; the interleaved schedules need v >= 2).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

# flag value -> torch.distributed.pipelining class name; multi: needs stages_per_rank >= 2
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True),
    "looped-bfs": ("ScheduleLoopedBFS", True),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", True),
}


def stage_layer_ranges(n_layers: int, num_stages: int, split_points: Sequence[int] | None = None
                       ) -> list[tuple[int, int]]:
    """Block index ranges ``[start, end)`` of each stage: even, or cut at ``split_points``."""
    if split_points:
        cuts = [0, *split_points, n_layers]
    else:
        per = n_layers // num_stages
        cuts = [i * per for i in range(num_stages)] + [n_layers]
    return list(zip(cuts[:-1], cuts[1:]))


def pipeline_problems(*, pp: int, n_layers: int, schedule: str, stages_per_rank: int, microbatches: int,
                      local_batch: int, split_points: Sequence[int] | None = None) -> list[str]:
    """What a pipeline configuration requires, each problem naming the values and a fix."""
    if pp <= 1:
        return []
    out = []
    if schedule not in SCHEDULES:
        return [f"unknown --pp-schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}"]
    multi = SCHEDULES[schedule][1]
    if multi and stages_per_rank < 2:
        out.append(f"--pp-schedule {schedule} interleaves several stages per rank; set --stages-per-rank 2 or more")
    if not multi and stages_per_rank != 1:
        out.append(f"--pp-schedule {schedule} runs one stage per rank; use --stages-per-rank 1 or an "
                   "interleaved schedule")
    num_stages = pp * stages_per_rank
    if split_points:
        if len(split_points) != num_stages - 1:
            out.append(f"--split-points {','.join(map(str, split_points))} gives {len(split_points) + 1} stages; "
                       f"pp={pp} x stages-per-rank={stages_per_rank} needs {num_stages - 1} split points")
        elif list(split_points) != sorted(set(split_points)) or split_points[0] <= 0 or split_points[-1] >= n_layers:
            out.append(f"--split-points {','.join(map(str, split_points))} must increase strictly within "
                       f"(0, {n_layers})")
    elif n_layers % num_stages:
        out.append(f"--n-layers {n_layers} does not split evenly into {num_stages} stages (pp={pp} x "
                   f"stages-per-rank={stages_per_rank}); use a multiple of {num_stages} or --split-points")
    if microbatches < 1:
        out.append(f"--microbatches {microbatches} must be >= 1")
    elif local_batch % microbatches:
        out.append(f"--microbatches {microbatches} does not divide the per-dp-rank batch {local_batch}; "
                   f"use a divisor of {local_batch}")
    elif not multi and microbatches < pp and schedule == "1f1b":
        out.append(f"--pp-schedule 1f1b needs --microbatches >= pp ({pp}); got {microbatches}")
    return out


def split_model(model: nn.Module, layer_range: tuple[int, int], *, first: bool, last: bool,
                layers_attr: str = "layers", pre: Sequence[str] = ("tok_embeddings",),
                post: Sequence[str] = ("norm", "output")) -> nn.Module:
    """A copy of ``model`` holding only the blocks in ``layer_range`` (plus ``pre`` modules on the
    first stage and ``post`` modules on the last); the others become ``None`` / are dropped."""
    part = copy.deepcopy(model)
    layers = getattr(part, layers_attr)
    start, end = layer_range
    for key in list(layers.keys()):
        if not start <= int(key) < end:
            del layers[key]
    if not first:
        for name in pre:
            setattr(part, name, None)
    if not last:
        for name in post:
            setattr(part, name, None)
    return part


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages this pipeline rank holds (looped placement)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_schedule(stages: list, *, schedule: str, microbatches: int, loss_fn):
    """The ``torch.distributed.pipelining`` schedule over this rank's stages."""
    import torch.distributed.pipelining as pipelining

    cls_name, multi = SCHEDULES[schedule]
    cls = getattr(pipelining, cls_name)
    return cls(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


class StageSet(nn.Module):
    """This rank's pipeline stages as one module whose parameters carry the full model's names
    (``layers.5.attention.wq.weight``, ``tok_embeddings.weight``...): one optimizer over them, and
    checkpoints that load on any pipeline split, or none. Not meant to be called: the schedule runs
    the stages."""

    def __init__(self, parts: Sequence[nn.Module], layers_attr: str = "layers") -> None:
        super().__init__()
        blocks = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == layers_attr:
                    for key, block in child.items():
                        blocks[key] = block
                elif child is not None:
                    if hasattr(self, name):
                        raise ValueError(f"two stages of this rank both hold {name!r}")
                    self.add_module(name, child)
        self.add_module(layers_attr, blocks)

    def forward(self, *args, **kwargs):  # pragma: no cover - a container, see the docstring
        raise RuntimeError("StageSet holds pipeline stages for the optimizer and checkpoints; run the schedule")
