"""Pipeline parallelism for any model whose repeated blocks are a ``ModuleList``, ``ModuleDict`` or ``Sequential``.

::

    from mmm.parallel import ParallelSpec, init_mesh
    from mmm.parallel.pipeline import build_pipeline
    mesh = init_mesh(pp=2)                                    # pp 2 x dp (inferred)
    pipe = build_pipeline(model, mesh, ParallelSpec(dtype="bf16"), loss_fn=F.cross_entropy, microbatches=4)
    opt = torch.optim.AdamW(pipe.module.parameters())         # this rank's stages, full-model names
    loss = pipe.step(inputs, targets)                         # forward + backward over all microbatches
    opt.step(); opt.zero_grad()

How a model is cut (:func:`split_model`): each stage keeps a copy of the model with only its
blocks; the modules with parameters registered before the blocks (an embedding) stay on the first
stage, those after (final norm, head) on the last, and elsewhere become ``nn.Identity``; modules
without parameters (a rotary table) stay everywhere. So the model's own forward runs each stage
unchanged, as long as it is "pre -> blocks in order -> post". Block names stay those of the full
model ("layers.5.attention.wq.weight"), so checkpoints of a pipelined model load into the plain
one. A stage's output that is not a tensor (a Hugging Face ``ModelOutput``) is reduced to its
``logits`` / ``last_hidden_state`` / first element. Each stage then goes through
:func:`mmm.parallel.compose.parallelize`, the one composition path (TP, AC, compile, FSDP, dtype).

Stages are placed the usual way: with p pipeline ranks and v stages per rank, rank r holds
stages r, r + p, ..., r + (v-1)p ("looped"; the interleaved schedules need v >= 2).
"""

from __future__ import annotations

import copy
import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmm.errors import API, Spelling, UsageError
from mmm.parallel.accumulate import accumulation_problems
from mmm.parallel.compose import (
    ParallelSpec,
    ac_problems,
    block_items,
    find_blocks,
    fsdp_wraps,
    get_submodule,
    parallelize,
)
from mmm.parallel.mesh import Mesh
from mmm.parallel.tensor import loss_parallel_context, resolve_plan

# flag value -> torch.distributed.pipelining class name; multi: needs stages_per_rank >= 2
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", False),
    "1f1b": ("Schedule1F1B", False),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", True),
    "looped-bfs": ("ScheduleLoopedBFS", True),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", True),
}


def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Block index ranges ``[start, end)`` of each stage: even, or cut at ``split_points``."""
    if split_points:
        cuts = [0, *split_points, n_layers]
    else:
        per = n_layers // num_stages
        cuts = [i * per for i in range(num_stages)] + [n_layers]
    return list(zip(cuts[:-1], cuts[1:]))


def pipeline_problems(
    *,
    pp: int,
    n_layers: int,
    schedule: str,
    stages_per_rank: int,
    microbatches: int,
    local_batch: int | None = None,
    split_points: Sequence[int] | None = None,
    spell: Spelling = API,
) -> list[str]:
    """What a pipeline configuration requires, each problem naming the values and a fix
    (``n_layers``: the model's blocks; ``local_batch``: the per-dp-rank batch the microbatches must
    divide, when known)."""
    if pp <= 1:
        return []
    out = []
    if schedule not in SCHEDULES:
        return [f"unknown {spell('schedule', schedule)}; choose one of: {', '.join(SCHEDULES)}"]
    multi = SCHEDULES[schedule][1]
    if multi and stages_per_rank < 2:
        out.append(
            f"{spell('schedule', schedule)} interleaves several stages per rank; set "
            f"{spell.name('stages_per_rank')} to 2 or more"
        )
    if not multi and stages_per_rank != 1:
        out.append(
            f"{spell('schedule', schedule)} runs one stage per rank; use {spell('stages_per_rank', 1)} or an "
            "interleaved schedule"
        )
    num_stages = pp * stages_per_rank
    stages = f"{num_stages} stages (pp={pp} x {stages_per_rank} per rank)"
    if split_points:
        if len(split_points) != num_stages - 1:
            out.append(
                f"{spell('split_points', list(split_points))} gives {len(split_points) + 1} stages; "
                f"{stages} need {num_stages - 1} split points"
            )
        elif list(split_points) != sorted(set(split_points)) or split_points[0] <= 0 or split_points[-1] >= n_layers:
            out.append(f"{spell('split_points', list(split_points))} must increase strictly within (0, {n_layers})")
    elif n_layers % num_stages:
        split = spell.name("split_points")
        out.append(
            f"{spell('n_layers', n_layers)}: no even split into {stages}; use a multiple of {num_stages}"
            + (f" or {split}" if split else f", or fewer stages ({spell.name('pp')}, {spell.name('stages_per_rank')})")
        )
    batch = accumulation_problems(microbatches, local_batch, spell=spell)  # the same rule as accumulation's
    out += batch
    if not batch and not multi and microbatches < pp and schedule == "1f1b":
        out.append(f"{spell('schedule', schedule)} needs {spell.name('microbatches')} >= pp ({pp}); got {microbatches}")
    return out


# --------------------------------------------------------------------------- splitting
def outer_modules(model: nn.Module, blocks: str) -> tuple[list[str], list[str]]:
    """Paths of the modules with parameters registered before (``pre``) and after (``post``) the
    blocks container, walking the path from the root to it."""
    pre, post = [], []
    mod, prefix = model, ""
    for part in blocks.split("."):
        seen = False
        for name, child in mod.named_children():
            if name == part:
                seen = True
                continue
            if child is None or next(child.parameters(), None) is None:
                continue  # no parameters: kept on every stage
            (post if seen else pre).append(prefix + name)
        mod, prefix = getattr(mod, part), f"{prefix}{part}."
    return pre, post


class StandIn(nn.Identity):
    """What a stage holds for a module of another stage: hands on its first input (the hidden state), whatever
    else it is called with (``embed(tokens, positions)``, ``embed(input_ids=x)``). ``side``: where the module
    it stands for runs, ``"before"`` or ``"after"`` the blocks (:func:`stand_in_guards`)."""

    def __init__(self, side: str) -> None:
        super().__init__()
        self.side = side

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()), None)


class KeptBlocks(nn.ModuleDict):
    """Some blocks of a ``ModuleList``, keyed by their index in the full model (so parameter names
    do not change), that still iterates, indexes and slices like the list a model's forward expects."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, idx):
        if isinstance(idx, str):
            return super().__getitem__(idx)
        return list(self.values())[idx]


def _tensor_output(module, args, output):
    """Forward hook: a stage hands the next one a tensor (logits / hidden state / first element)."""
    if isinstance(output, torch.Tensor):
        return None
    value = next(
        (
            getattr(output, k)
            for k in ("logits", "last_hidden_state")
            if isinstance(getattr(output, k, None), torch.Tensor)
        ),
        None,
    )
    if value is None and isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        value = output[0]
    if value is not None:  # a view (HF slices its logits) would lose FSDP's pre-backward hook to in-place ops
        return value.clone() if value._is_view() else value
    raise TypeError(
        f"a pipeline stage of {type(module).__name__} returned {type(output).__name__}; "
        "pipeline stages must return a tensor"
    )


def _no_blocks(model: nn.Module) -> str:
    return (
        f"{type(model).__name__} has no ModuleList, ModuleDict or Sequential of repeated blocks to split "
        "into pipeline stages; hold its blocks in one (self.layers = nn.ModuleList([...])), or name the one "
        "that holds them with the blocks setting (e.g. 'model.layers')"
    )


def split_model(
    model: nn.Module,
    layer_range: tuple[int, int],
    *,
    first: bool,
    last: bool,
    blocks: str | None = "auto",
    pre: Sequence[str] | None = None,
    post: Sequence[str] | None = None,
) -> nn.Module:
    """A copy of ``model`` holding only the blocks in ``layer_range`` (by position), plus the
    ``pre`` modules on the first stage and the ``post`` modules on the last (default: found by
    :func:`outer_modules`); the others become ``nn.Identity``. Dropped blocks are not copied."""
    path = find_blocks(model, blocks)
    if path is None:
        raise UsageError(_no_blocks(model))
    auto_pre, auto_post = outer_modules(model, path)
    pre = auto_pre if pre is None else list(pre)
    post = auto_post if post is None else list(post)
    container = get_submodule(model, path)
    items = block_items(container)
    start, end = layer_range
    memo: dict[int, Any] = {id(b): None for i, (_, b) in enumerate(items) if not start <= i < end}
    for side, names in (("before", [] if first else pre), ("after", [] if last else post)):
        for name in names:
            memo[id(get_submodule(model, name))] = StandIn(side)
    part = copy.deepcopy(model, memo)
    copied = get_submodule(part, path)._modules  # by key: the dropped blocks are None there
    kept = {str(k): copied[str(k)] for i, (k, _) in enumerate(items) if start <= i < end}
    parent_path, _, attr = path.rpartition(".")
    parent = get_submodule(part, parent_path)
    if isinstance(container, nn.Sequential):  # still runs its blocks in order, under their own names
        setattr(parent, attr, nn.Sequential(OrderedDict(kept)))
    else:
        setattr(parent, attr, nn.ModuleDict(kept) if isinstance(container, nn.ModuleDict) else KeptBlocks(kept))
    part.register_forward_hook(_tensor_output)
    return part


def _path_owners(blocks: str) -> list[str]:
    """The modules on the path from the root to the blocks container (root = "")."""
    parts = blocks.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def tied_across_stages(model: nn.Module, blocks: str | None = "auto") -> list[str]:
    """Parameters shared between the pre and post modules (tied embeddings): a pipeline cannot split them."""
    path = find_blocks(model, blocks)
    if path is None:
        return []
    pre, post = outer_modules(model, path)
    first = {id(p): f"{n}.{pn}" for n in pre for pn, p in get_submodule(model, n).named_parameters()}
    return [
        f"{first[id(p)]} = {n}.{pn}"
        for n in post
        for pn, p in get_submodule(model, n).named_parameters()
        if id(p) in first
    ]


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stages this pipeline rank holds (looped placement)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_schedule(stages: list, *, schedule: str, microbatches: int, loss_fn):
    """The ``torch.distributed.pipelining`` schedule over this rank's stages."""
    import torch.distributed.pipelining as pipelining

    cls_name, multi = SCHEDULES[schedule]
    cls = getattr(pipelining, cls_name)
    return cls(stages if multi else stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def _stage_class(base: type) -> type:
    """torch's ``PipelineStage`` whose first-step shape inference (torch 2.13 runs the stage on real
    tensors, forward and backward) leaves no trace in a router's token counts (which balance the
    experts, :mod:`mmm.parallel.experts`): its ``counting`` is off meanwhile. Older torch infers
    shapes on meta tensors without gradients, which routers do not count: nothing to do."""
    if not hasattr(base, "_compute_outputs"):
        return base

    class Stage(base):
        def _compute_outputs(self, *args, module, **kwargs):
            counters = [(m, m.counting) for m in module.modules() if hasattr(m, "counting")]
            for m, _ in counters:
                m.counting = False
            try:
                return super()._compute_outputs(*args, module=module, **kwargs)
            finally:
                for m, was in counters:
                    m.counting = was

    return Stage


def _state_buffers(mod: nn.Module) -> list[str]:
    """The buffers of ``mod`` itself that its state_dict holds (persistent ones)."""
    return [k for k, b in mod._buffers.items() if b is not None and k not in mod._non_persistent_buffers_set]


class StageSet(nn.Module):
    """This rank's pipeline stages as one module whose parameters carry the full model's names
    (``layers.5.attention.wq.weight``, ``model.embed_tokens.weight``...): one optimizer over them,
    and checkpoints that load on any pipeline split, or none. Not meant to be called: the schedule
    runs the stages. Built from the modules that own parameters or saved buffers (a router's balancing
    bias), under empty parent modules."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self._parts = list(parts)  # plain list: not submodules (their parameters are registered below)
        for part in parts:
            for name, mod in part.named_modules():
                if not name or (next(mod.parameters(recurse=False), None) is None and not _state_buffers(mod)):
                    continue
                *parents, leaf = name.split(".")
                holder: nn.Module = self
                for p in parents:
                    if p not in holder._modules:
                        holder.add_module(p, nn.Module())
                    holder = holder._modules[p]
                if leaf in holder._modules:
                    if holder._modules[leaf] is not mod:
                        raise ValueError(f"two stages of this rank both hold {name!r}")
                    continue
                holder.add_module(leaf, mod)

    @property
    def parts(self) -> list[nn.Module]:
        """This rank's stages, whole (every module, not only those that own state)."""
        return list(self._parts)

    def train(self, mode: bool = True) -> StageSet:
        """Train/eval mode reaches every module of the stages (dropout, too), not only parameter owners."""
        super().train(mode)
        for part in self._parts:
            part.train(mode)
        return self

    def forward(self, *args, **kwargs):  # pragma: no cover - a container, see the docstring
        raise RuntimeError("StageSet holds pipeline stages for the optimizer and checkpoints; run the schedule")


# --------------------------------------------------------------------------- the driver
class Pipeline:
    """This rank's stages and their schedule: ``step(inputs, targets) -> loss`` runs forward and
    backward over every microbatch (gradients averaged over them) and returns the mean loss over
    microbatches on every pipeline rank (the last stage computes it and shares it over pp)."""

    def __init__(
        self,
        *,
        module: StageSet,
        schedule,
        stage_ids: list[int],
        num_stages: int,
        layer_ranges: list[tuple[int, int]],
        microbatches: int,
        schedule_name: str,
        pp_group,
        loss_parallel: bool,
        device: torch.device,
        explain: Callable[[torch.Tensor], str | None] | None = None,
        first_step_hooks: Sequence[Any] = (),
    ) -> None:
        self.module, self.schedule, self.stage_ids, self.num_stages = module, schedule, stage_ids, num_stages
        # before the first step: why the stages would fail or mix tensors where the whole model does not
        self._explain = explain
        self._first_step_hooks = list(first_step_hooks)  # checks of the first step's forward, removed after it
        self.layer_ranges, self.microbatches, self.schedule_name = layer_ranges, microbatches, schedule_name
        self.pp_group, self.loss_parallel, self.device = pp_group, loss_parallel, device
        self.has_first, self.has_last = 0 in stage_ids, num_stages - 1 in stage_ids
        # the last stage keeps no microbatch's output for the step to return (the losses are what is
        # read): otherwise it holds every microbatch's logits until the step ends (Llama-3-8B, 64
        # microbatches of 8,192 tokens at TP 2: 128 GiB). A PyTorch without the choice keeps them.
        takes = "return_outputs" in inspect.signature(schedule.step).parameters
        self._no_outputs = {"return_outputs": False} if takes else {}
        self._batch: int | None = None  # the first step's: the stages took their shapes from it

    def _check_batch(self, inputs: torch.Tensor, *, training: bool) -> None:
        """One line instead of a stage's shape error (or a hang) for a batch the schedule cannot take; every
        rank is given the batch, so every rank refuses it alike."""
        n = inputs.shape[0]
        if n % self.microbatches:
            raise UsageError(
                f"a batch of {n} does not split into {self.microbatches} microbatches; give a batch divisible by "
                f"{self.microbatches} (or build the pipeline with microbatches dividing {n})"
            )
        if training and self._batch is not None and n != self._batch:
            raise UsageError(
                f"a batch of {n} after the first step's {self._batch}: the pipeline's stages took their shapes "
                f"from the first step; keep the batch size at {self._batch} (or build a new pipeline)"
            )
        if training:
            self._batch = n

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, *, share_loss: bool = True) -> torch.Tensor:
        """Forward and backward over every microbatch; the mean loss over microbatches on every pipeline
        rank (``share_loss=False``: on the last stage's ranks only, zero elsewhere, with no collective:
        for a caller that reduces it with other values, as mmm's training step does)."""
        first = self._batch is None
        self._check_batch(inputs, training=True)
        if first and self._explain is not None:  # every rank runs every stage on meta: all refuse alike
            explain, self._explain = self._explain, None  # its meta copy of the model is not kept
            problem = explain(inputs[: inputs.shape[0] // self.microbatches])
            if problem:
                raise UsageError(problem)
        losses: list = []
        try:
            with loss_parallel_context(self.loss_parallel):
                self.schedule.step(
                    *((inputs,) if self.has_first else ()),
                    target=targets if self.has_last else None,
                    losses=losses if self.has_last else None,
                    **self._no_outputs,
                )
        finally:
            for handle in self._first_step_hooks:
                handle.remove()
            self._first_step_hooks = []
        if self.has_last:
            loss = torch.stack(
                [(x.full_tensor() if hasattr(x, "full_tensor") else x).detach().float() for x in losses]
            ).mean()
        else:
            loss = torch.zeros((), device=self.device)
        if not share_loss:
            return loss
        loss = loss.reshape(1)
        dist.all_reduce(loss, group=self.pp_group)
        return loss.reshape(())

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only over every microbatch: the mean loss over microbatches on the last stage's
        ranks, zero elsewhere (no collective; the caller reduces it, as with ``share_loss=False``)."""
        if not hasattr(self.schedule, "eval"):
            raise UsageError(
                f"evaluation needs a forward-only pipeline pass, which schedule {self.schedule_name} "
                "does not have here; build the pipeline with schedule='1f1b' or 'gpipe', or do not evaluate"
            )
        self._check_batch(inputs, training=False)
        losses: list = []
        with loss_parallel_context(self.loss_parallel):
            self.schedule.eval(
                *((inputs,) if self.has_first else ()),
                target=targets if self.has_last else None,
                losses=losses if self.has_last else None,
                **self._no_outputs,
            )
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack(
            [(x.full_tensor() if hasattr(x, "full_tensor") else x).detach().float() for x in losses]
        ).mean()

    def describe(self) -> str:
        blocks = ", ".join(f"{a}-{b - 1}" for a, b in self.layer_ranges)
        return (
            f"pipeline: {self.num_stages} stages (blocks {blocks}), "
            f"schedule {self.schedule_name}, {self.microbatches} microbatches; this rank holds stages "
            f"{self.stage_ids}"
        )


def build_pipeline(
    model: nn.Module,
    mesh: Mesh,
    spec: ParallelSpec | None = None,
    *,
    loss_fn: Callable,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    split_points: Sequence[int] | None = None,
    device: torch.device | None = None,
    pre: Sequence[str] | None = None,
    post: Sequence[str] | None = None,
    seed: int | None = None,
    init: Callable[[nn.Module], None] | None = None,
) -> Pipeline:
    """Split ``model`` into ``mesh.pp x stages_per_rank`` stages, put each of this rank's stages
    through :func:`parallelize` with ``spec``, and build the schedule. ``model`` is consumed.
    A model built under :func:`mmm.parallel.meta_init` stays on ``meta`` until each stage is
    sharded; then only this rank's stages are materialised (``seed``, ``init``: see
    :func:`parallelize`)."""
    from torch.distributed.pipelining import PipelineStage

    spec = spec or ParallelSpec()
    if not mesh.pp_enabled:
        raise UsageError("build_pipeline() needs a mesh with pp > 1 (init_mesh(pp=...)); use parallelize() without PP")
    path = find_blocks(model, spec.blocks)
    if path is None:
        raise UsageError(_no_blocks(model))
    own = [
        name or type(model).__name__
        for name in _path_owners(path)
        if next(get_submodule(model, name).parameters(recurse=False), None) is not None
    ]
    if own:
        raise UsageError(
            f"{', '.join(own)} hold parameters of their own beside the blocks (e.g. a class token or "
            "position table): a pipeline would copy them into every stage; move them into a submodule "
            "(an embedding module before the blocks)"
        )
    if spec.tp_plan:
        resolve_plan(model, spec.tp_plan)  # every pattern must name a module of the whole model
    tied = tied_across_stages(model, path)
    if tied:
        raise UsageError(
            f"tied weights ({'; '.join(tied)}) cannot be split over pipeline stages; untie them "
            "(e.g. tie_word_embeddings=False)"
        )
    n_blocks = len(get_submodule(model, path))
    pp, num_stages = mesh.pp, mesh.pp * stages_per_rank
    microbatches = pp if microbatches is None else microbatches  # 0 is refused, not taken as the default
    problems = pipeline_problems(
        pp=pp,
        n_layers=n_blocks,
        schedule=schedule,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        split_points=split_points,
    )
    problems += ac_problems(spec.ac, mesh.dims, schedule=schedule)
    if problems:
        raise UsageError("; ".join(problems))
    if device is None:
        device = next(model.parameters()).device
        if device.type == "meta":
            raise UsageError(f"{type(model).__name__} is on the meta device: pass device= to build_pipeline()")
    ranges = stage_layer_ranges(n_blocks, num_stages, split_points)
    mine = stage_ids(mesh.coord("pp"), pp, stages_per_rank)
    stage_spec = spec.replace(blocks=path, allow_missing=True)
    if spec.reshard_after_forward is None and fsdp_wraps(mesh.dims, spec.dp, spec.dtype):
        # a stage runs forward for every microbatch before their backwards: resharding after each
        # forward would all-gather its parameters again for every microbatch, twice
        stage_spec = stage_spec.replace(reshard_after_forward=False)
    parts, stages, guards = [], [], []
    for sid in mine:
        part = split_model(
            model, ranges[sid], first=sid == 0, last=sid == num_stages - 1, blocks=path, pre=pre, post=post
        )
        part = parallelize(part, mesh, stage_spec, device=device, seed=seed, init=init)
        guards += stand_in_guards(part, path, sid)
        parts.append(part)
        stages.append(_stage_class(PipelineStage)(part, sid, num_stages, device, group=mesh.group("pp")))
    sched = build_schedule(stages, schedule=schedule, microbatches=microbatches, loss_fn=loss_fn)
    on_meta = all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
    try:  # a model on meta is held as it is (no memory); one that cannot be copied is not checked
        skeleton = model if on_meta else meta_copy(model)
    except Exception:
        skeleton = None

    def explain(microbatch: torch.Tensor) -> str | None:
        return split_problem(skeleton, microbatch, ranges, blocks=path, pre=pre, post=post)

    return Pipeline(
        module=StageSet(parts),
        schedule=sched,
        stage_ids=mine,
        num_stages=num_stages,
        layer_ranges=ranges,
        microbatches=microbatches,
        schedule_name=schedule,
        pp_group=mesh.group("pp"),
        loss_parallel=spec.loss_parallel and mesh.tp_enabled,
        device=device,
        explain=explain if skeleton is not None and device.type != "meta" else None,  # not in a simulated step
        first_step_hooks=guards,
    )


def stand_in_guards(stage: nn.Module, blocks: str, sid: int) -> list:
    """Hooks on a stage's stand-ins (:class:`StandIn`) for the modules it does not hold: one for a module that
    runs before the blocks must be handed the stage's input (the hidden state, as a chain from the model's
    input is), one for a module after them must run after them. A forward that combines two modules before
    the blocks (``tok(x) + pos(p)``), or a module registered after the blocks that runs before them, would
    add the wrong tensor to the hidden state, silently where the shapes allow it: refused in one line at
    the first step instead."""
    seen: dict[str, Any] = {}
    fix = (
        "one tensor goes from stage to stage, and the model is split at its blocks in the order its modules "
        "are registered: register them in the forward's order, and combine what runs before the blocks in "
        "one module (tok(x) + pos(p): one embedding module that adds both, called as embed(x, p))"
    )

    def stage_input(module, args, kwargs):
        seen["input"], seen["blocks_ran"] = (args[0] if args else next(iter(kwargs.values()), None)), False

    def block_ran(module, args, output):
        seen["blocks_ran"] = True

    def before(name):
        def hook(module, args, kwargs):
            args = args or tuple(kwargs.values())[:1]  # embed(input_ids=x): its first keyword
            if seen.get("blocks_ran"):
                raise UsageError(
                    f"{name} is registered before the blocks but runs after them (on pipeline stage {sid}, which "
                    f"does not hold it); {fix}"
                )
            if not args or args[0] is not seen.get("input"):
                what = f"a {type(args[0]).__name__}" if args else "nothing"
                shape = f" of shape {tuple(args[0].shape)}" if args and isinstance(args[0], torch.Tensor) else ""
                raise UsageError(
                    f"{name} runs before the blocks, and on pipeline stage {sid} (which does not hold it) the "
                    f"forward hands it {what}{shape} other than the stage's input; {fix}"
                )

        return hook

    def after(name):
        def hook(module, args, kwargs):
            if not seen.get("blocks_ran"):
                raise UsageError(
                    f"{name} is registered after the blocks but runs before them (on pipeline stage {sid}, which "
                    f"does not hold it); {fix}"
                )

        return hook

    handles = [stage.register_forward_pre_hook(stage_input, with_kwargs=True)]
    handles += [block.register_forward_hook(block_ran) for _, block in block_items(get_submodule(stage, blocks))]
    for name, stand_in in stage.named_modules():
        if isinstance(stand_in, StandIn):
            guard = before if stand_in.side == "before" else after
            handles.append(stand_in.register_forward_pre_hook(guard(name), with_kwargs=True))
    return handles


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta``: its structure, no memory."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


@torch.no_grad()
def split_problem(
    model: nn.Module,
    microbatch: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    *,
    blocks: str,
    pre: Sequence[str] | None = None,
    post: Sequence[str] | None = None,
    whole_ranges: bool = False,
) -> str | None:
    """Why the stages of ``model`` (on meta) fail on ``microbatch``, or hand a stand-in the wrong tensor
    (:func:`stand_in_guards`), where the whole model runs: the split (modules registered out of forward
    order, two modules before the blocks combined in the forward). None when every stage runs, or when the
    whole model does not run on meta (its own error, if any, is the one to see)."""
    x = microbatch.to("meta")

    def runs_whole() -> bool:  # asked only when a stage fails: a model that does not run on meta is not checked
        try:
            model(microbatch.to("meta"))
        except Exception:
            return False
        return True

    for sid, (start, end) in enumerate(ranges):  # first each stage with its first block alone: fewer ops
        last = sid == len(ranges) - 1
        kept = (start, end) if whole_ranges else (start, start + 1)
        try:
            stage = split_model(model, kept, first=sid == 0, last=last, blocks=blocks, pre=pre, post=post)
        except Exception:  # a stage that cannot be copied on meta: not checked here (the real step's guards are)
            return None
        stand_in_guards(stage, blocks, sid)
        try:
            x = stage(x)
        except UsageError as err:  # a stand-in handed the wrong tensor
            return str(err) if runs_whole() else None
        except Exception as err:
            if not runs_whole():  # the model's own error (or none on a device), not the split's
                return None
            if not whole_ranges:  # blocks that change the width: each stage with all of its blocks decides
                return split_problem(model, microbatch, ranges, blocks=blocks, pre=pre, post=post, whole_ranges=True)
            said = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            return (
                f"stage {sid} of {type(model).__name__}'s pipeline fails on what the stage before it hands on "
                f"({type(err).__name__}: {said}), though the whole model runs: the model is split at its blocks "
                "in the order its modules are registered, and one tensor goes from stage to stage; register its "
                "modules in the forward's order (the head after the blocks) and combine what runs before the "
                "blocks in one module (tok(x) + pos(p): one embedding module, called as embed(x, p))"
            )
    return None
