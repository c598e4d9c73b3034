"""Expert parallel: a mixture of experts' routed experts split over the ``ep`` ranks, tokens sent to
their experts and back by all-to-all; and the balancing step every mixture of experts needs.

A plan for experts is data, like a TP plan: module-name patterns -> ``"experts"``, naming each module
that holds the routed experts (mmm's Llama: ``{"layers.*.moe.experts": "experts"}``). What such a
module must be, for any model:

- each of its parameters holds the experts along dim 0 (``(num_experts, ...)``), and its forward
  runs the experts whose weights it holds, on tokens sorted by expert
  (``forward(x, counts)``; a parameter may be a DTensor: use its ``to_local()``);
- its parent calls ``self.run_experts(experts, x, counts)`` (``counts[e]`` tokens for expert e, all
  experts, in order) to run it: :func:`apply_ep` swaps in :class:`ExpertParallel` there.

A Hugging Face experts module (transformers 5: Qwen3-MoE, Mixtral, ...: ``gate_up_proj`` (E, 2I, D)
with gate and up concatenated, ``down_proj`` (E, D, I), ``act_fn``, called as
``experts(hidden_states, top_k_index, top_k_weights)``) needs no hook: :func:`apply_ep` gives it a
forward that sorts its tokens by expert and sends them through :class:`ExpertParallel`; its config's
``base_model_ep_plan`` names it (``"layers.*.mlp.experts": "ep_dispatch_experts"``, :func:`hf_ep_plan`).

:func:`apply_ep` makes each parameter a DTensor sharded on dim 0 over ``mesh["ep"]`` (each rank
holds ``num_experts / ep`` consecutive experts); :func:`mmm.parallel.compose.parallelize` then
shards them by FSDP over ``mesh["efsdp"]`` (the rest of dp_shard x cp) with the gradient divided by
all of dp_shard x cp, as one process averages over the whole batch: every token of the group reached
its expert. The global gradient norm counts each expert once (DTensors on their own mesh).

Balancing (:func:`balance_experts`): modules with a ``tokens_per_expert`` buffer (a router; mmm's is
:class:`mmm.models.llama.moe.Router`) count what they routed; after each optimizer step their counts
are summed over every rank holding other tokens (data and context parallel, and the microbatches
already), their ``expert_bias`` moved towards balance by ``bias_rate``, and the step's figures
(tokens per expert, min and max; the auxiliary loss) returned for the record: the same on every
layout as in one process.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
import torch.distributed as dist
from torch import nn

from mmm.errors import UsageError
from mmm.models.grouped import counts_tokens, grouped_linear, grouped_mm_available, no_tokens, padded_groups
from mmm.parallel.context import all_to_all, all_to_all_autograd
from mmm.parallel.meta import own_class
from mmm.parallel.tensor import closest_patterns

EP_STYLES = ("experts",)


def _matches(name: str, pattern: str) -> bool:
    parts, pat = name.split("."), pattern.split(".")
    return len(parts) == len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat))


def expert_modules(model: nn.Module, plan, *, allow_missing: bool = False) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs an experts plan names, checked: every pattern matches (unless
    ``allow_missing``: a pipeline stage holds part of the model), every style is "experts"."""
    found: list[tuple[str, nn.Module]] = []
    for pattern, style in plan.items():
        if style not in EP_STYLES:
            raise UsageError(f"experts plan {pattern!r}: unknown style {style!r}; the style is {EP_STYLES[0]!r}")
        hits = [(n, m) for n, m in model.named_modules() if _matches(n, pattern)]
        if not hits and not allow_missing:
            close = closest_patterns([pattern], [n for n, _ in model.named_modules() if n])
            raise UsageError(
                f"experts plan pattern {pattern!r} matches no module of {type(model).__name__}"
                + (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "")
            )
        found += hits
    return found


def ep_degrees(num_experts: int, room: int | None = None) -> list[int]:
    """The ep degrees that split ``num_experts`` (and divide ``room``, the dp_shard x cp ranks ep borrows
    from, when given), the largest first."""
    return [d for d in range(num_experts, 0, -1) if not num_experts % d and (room is None or not room % d)]


def ep_problems(*, ep: int, num_experts: int, room: int | None = None, spell=None) -> list[str]:
    """What an ep degree requires of the model: its experts split evenly (``room``: the ranks ep borrows
    from, dp_shard x cp, to name the degrees that would do)."""
    if ep > 1 and num_experts % ep:
        name = "num_experts" if spell is None else spell.name("moe_experts")
        degree = (lambda d: f"ep={d}") if spell is None else (lambda d: spell("ep", d))
        which = f"use {' or '.join(degree(d) for d in ep_degrees(num_experts, room)[:2])}" + (
            f" (dividing both {num_experts} and dp_shard x cp = {room})" if room is not None else ""
        )
        return [
            f"{name} {num_experts} is not divisible by ep={ep}; each expert-parallel rank holds as many experts: "
            + which
        ]
    return []


class ExpertParallel:
    """``run_experts(experts, x, counts)`` over the ep group: send each token to the rank of its expert
    (all-to-all, uneven), run the experts held here, send the outputs back. Model copies (pipeline
    stages) share it."""

    def __init__(self, group) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.planned = False  # a simulated step: every peer routes as this rank does (no values to read)

    def __deepcopy__(self, memo) -> ExpertParallel:
        return self

    def __call__(self, experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``experts(x, counts)`` runs the experts held here on their tokens, sorted by expert."""
        ep, n = self.size, len(counts)
        per = n // ep
        mine = torch.tensor(counts, dtype=torch.int64, device=x.device).view(ep, per)  # [to rank, its expert]
        theirs = all_to_all(mine, self.group, axis="ep")  # [from rank, my expert]: what each peer sends me
        if self.planned:  # no values to read: every peer routes as this rank does
            r = dist.get_rank(self.group)
            sizes = counts[r * per : (r + 1) * per] * ep
        else:
            sizes = theirs.flatten().tolist()
        send = [sum(counts[i * per : (i + 1) * per]) for i in range(ep)]
        got = [sum(sizes[s * per : (s + 1) * per]) for s in range(ep)]
        received = all_to_all_autograd(x, self.group, send, got, axis="ep")  # grouped by source, then expert
        # regroup by expert (then source) for the experts held here, and back afterwards
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        spans = [(starts[s * per + e], sizes[s * per + e]) for e in range(per) for s in range(ep)]
        order = torch.cat([torch.arange(a, a + size, device=x.device) for a, size in spans])
        held = [sum(sizes[s * per + e] for s in range(ep)) for e in range(per)]
        out = experts(received.index_select(0, order), held)
        if not out.requires_grad and torch.is_grad_enabled() and _trains(experts, received):
            raise UsageError(_cut_off(experts, held), same_on_all_ranks=False)
        back = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all_autograd(back, self.group, got, send, axis="ep")


def _trains(experts, received: torch.Tensor) -> bool:
    """Whether this forward's backward reaches the experts (their tokens' gradients, or their weights'): a
    training forward (an evaluation outside ``no_grad`` has no backward to wait in)."""
    if isinstance(experts, nn.Module) and not experts.training:
        return False
    weights = experts.parameters() if isinstance(experts, nn.Module) else ()
    return received.requires_grad or any(w.requires_grad for w in weights)


def _cut_off(experts, held: list[int]) -> str:
    """What to say when the experts' output on this rank takes no part in backward: its peers would wait
    in the all-to-all that returns their tokens' gradients (until MMM_TIMEOUT) while this rank skips it."""
    what = own_class(experts) if isinstance(experts, nn.Module) else "the experts module"
    got = f"its {sum(held)} tokens" if sum(held) else "no tokens"
    return (
        f"expert parallel: {what}'s output on this rank ({got} for its {len(held)} experts) takes no part in "
        "backward, so this rank would skip the all-to-all its peers wait in; keep the input and every weight in "
        "the output's graph even with no tokens (mmm.models.grouped.no_tokens(x, features, *weights), or add "
        "0.0 * (x.sum() + w.sum()) for each weight w)"
    )


class _CopyToTP(torch.autograd.Function):
    """Forward: as is; backward: the gradient summed over the TP group (each TP rank's experts hold part of
    the hidden width, so each sees part of the input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Forward: the experts' partial outputs summed over the TP group; backward: the gradient as is (every
    TP rank holds the whole output)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ExpertTensorParallel:
    """``run_experts(experts, x, counts)`` with the experts' hidden width split over the TP group: every
    TP rank routes the same tokens (the mixture's input is gathered over the sequence first), runs its
    part of each expert (``w1``/``w3`` by rows, ``w2`` by columns), and the parts are summed; under
    expert parallel too (``inner``: the all-to-all that brings each expert its tokens)."""

    def __init__(self, group, inner: ExpertParallel | None = None) -> None:
        self.group, self.inner = group, inner

    def __deepcopy__(self, memo) -> ExpertTensorParallel:
        return self

    def __call__(self, experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        def run(tokens: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            return _SumOverTP.apply(experts(_CopyToTP.apply(tokens, self.group), per_expert), self.group)

        return self.inner(run, x, counts) if self.inner is not None else run(x, counts)


def apply_ep(model: nn.Module, mesh, plan, *, allow_missing: bool = False) -> list[nn.Module]:
    """Split the experts ``plan`` names over ``mesh["ep"]`` (each rank holds experts / ep of them) and,
    with tp > 1, their hidden width over ``mesh["tp"]`` (in place; on meta too), and swap the dispatch
    into their parents' ``run_experts`` (:class:`ExpertParallel`, :class:`ExpertTensorParallel`).
    Returns the experts modules that FSDP shards apart, over ``mesh["efsdp"]`` (with ep > 1; else
    none: they are sharded with their block)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    ep, tp = mesh.ep, mesh.tp
    if ep > 1 and tp > 1:
        experts_mesh = mesh["ep_etp"]
    else:
        experts_mesh = mesh["ep"] if ep > 1 else mesh["tp"]
    inner = ExpertParallel(mesh["ep"].get_group()) if ep > 1 else None
    hook = ExpertTensorParallel(mesh["tp"].get_group(), inner) if tp > 1 else inner
    out = []
    for name, module in expert_modules(model, plan, allow_missing=allow_missing):
        parent = model.get_submodule(name.rpartition(".")[0])
        hf = hf_experts_problem(module) is None
        if not hasattr(parent, "run_experts") and not hf:
            raise UsageError(
                f"{name}'s parent ({type(parent).__name__}) has no run_experts(experts, x, counts) hook, and "
                f"{type(module).__name__} is not a Hugging Face experts module mmm runs "
                f"({hf_experts_problem(module)}); expert parallel sends tokens to their experts through one of "
                "them (mmm.parallel.experts)"
            )
        split = (
            HF_TP_DIMS if hf and not hasattr(parent, "run_experts") else getattr(module, "tensor_parallel_dims", None)
        )
        if tp > 1 and split is None:
            raise UsageError(
                f"tp={tp}: {name} ({type(module).__name__}) does not say how its experts split over TP ranks (a "
                "tensor_parallel_dims mapping of parameter name -> its hidden dimension); use tp=1"
            )
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise UsageError(f"{name}.{pname} holds {param.shape[0]} experts, not divisible by ep={ep}")
            placements = [Shard(0)] if ep > 1 else []
            if tp > 1:
                dim, packed = split[pname] if isinstance(split[pname], tuple) else (split[pname], 1)
                if param.shape[dim] % (tp * packed):
                    raise UsageError(f"{name}.{pname}: its hidden width {param.shape[dim]} does not split over tp={tp}")
                # a packed weight (gate and up, one after the other) gives each rank its rows of both
                placements.append(_StridedShard(dim, split_factor=packed) if packed > 1 else Shard(dim))
            sharded = distribute_tensor(param.data, experts_mesh, placements, src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
        if hasattr(parent, "run_experts"):
            parent.run_experts = hook
        else:
            module.forward = _HFExpertsForward(module, hook)
        if ep > 1:
            out.append(module)
    return out


# --------------------------------------------------------------------------- Hugging Face experts
HF_TP_DIMS = {"gate_up_proj": (1, 2), "down_proj": 2}
"""How a Hugging Face experts module splits over TP ranks: gate_up_proj's rows, packed (gate, then up: each
rank takes its rows of both), down_proj's columns."""


def hf_experts_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not a Hugging Face experts module expert parallel can run (None: it is)."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or not hasattr(module, "act_fn"):
        return "no gate_up_proj, down_proj and act_fn"
    if up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} are not 3-D (experts first)"
    layout = {k: getattr(module, k, d) for k, d in (("has_bias", False), ("is_transposed", False))}
    layout |= {k: getattr(module, k, d) for k, d in (("is_concatenated", True), ("has_gate", True))}
    if layout != {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}:
        return f"its layout {layout} is not gate and up concatenated, untransposed, without bias"
    return None


def hf_ep_plan(config, prefix: str = "") -> dict[str, str]:
    """An experts plan from a transformers config's ``base_model_ep_plan``: the modules it dispatches
    tokens to (``ep_dispatch_experts``), rooted at ``prefix`` (e.g. ``"model."``); {} when it has none.
    Given the model itself (``hf_ep_plan(model)``, as ``hf_tp_plan``), its config, rooted at the model."""
    if isinstance(config, nn.Module):
        model, config = config, getattr(config, "config", None)
        base = getattr(model, "base_model_prefix", "")
        if not prefix and base and getattr(model, base, None) is not None:
            prefix = f"{base}."
    plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    return {f"{prefix}{k}": "experts" for k, v in plan.items() if v == "ep_dispatch_experts"}


class _HFExpertsForward:
    """``experts(hidden_states, top_k_index, top_k_weights)`` of a Hugging Face experts module, its tokens
    sorted by expert and sent through ``hook`` (expert parallel); the weighted sum over each token's k."""

    def __init__(self, module: nn.Module, hook, grouped: bool | None = None) -> None:
        self.module, self.hook = module, hook
        self.planned_counts = None  # a simulated step: (token slots, experts) -> tokens per expert
        # the experts as two grouped matmuls (mmm.models.grouped); None: where they pay (CUDA 9.0+), else a loop
        self.grouped = grouped

    def __deepcopy__(self, memo) -> _HFExpertsForward:  # a pipeline stage's copy gets its own module's
        return _HFExpertsForward(memo.get(id(self.module), self.module), self.hook, self.grouped)

    def run(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts held here, on their tokens sorted by expert (the module's own weights and activation)."""
        experts = self.module
        up = experts.gate_up_proj.to_local() if hasattr(experts.gate_up_proj, "to_local") else experts.gate_up_proj
        down = experts.down_proj.to_local() if hasattr(experts.down_proj, "to_local") else experts.down_proj
        if x.shape[0] and (self.grouped if self.grouped is not None else grouped_mm_available(x)):
            xp, rows, offs = padded_groups(x, counts)
            with torch.autocast(x.device.type, enabled=False):  # the kernel takes one dtype: the tokens'
                gate, upx = grouped_linear(xp, up, offs).chunk(2, dim=-1)
                return grouped_linear(experts.act_fn(gate) * upx, down, offs).index_select(0, rows)
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):
            if xe.shape[0]:
                gate, upx = torch.nn.functional.linear(xe, up[e]).chunk(2, dim=-1)
                outs.append(torch.nn.functional.linear(experts.act_fn(gate) * upx, down[e]))
        if not outs:
            return no_tokens(x, down.shape[1], up, down)
        return torch.cat(outs)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        if self.planned_counts is not None:
            counts = self.planned_counts(flat.numel(), self.hook_experts())
        else:
            counts = torch.bincount(flat, minlength=self.hook_experts()).tolist()
        routed = self.hook(self.run, hidden_states[order // k], counts)
        slots = torch.empty_like(routed).index_copy(0, order, routed)
        weighted = slots.view(-1, k, slots.shape[-1]) * top_k_weights.unsqueeze(-1).to(slots.dtype)
        return weighted.sum(dim=1).to(hidden_states.dtype)

    def hook_experts(self) -> int:
        """Every expert of the model (this rank holds 1/ep of them)."""
        return self.module.gate_up_proj.shape[0]


# --------------------------------------------------------------------------- the load of a model's own router
def _count_tokens(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a Hugging Face experts module: adds up the tokens its router handed each expert
    (``top_k_index``), in training forwards only: not an AC recomputation (in backward), nor a pipeline's
    shape inference or a simulated step (``counting`` off)."""
    if not counts_tokens(module):
        return
    if len(args) > 1:  # (hidden_states, top_k_index, top_k_weights), positional in transformers' models
        index = args[1]
    else:  # by keyword, whose name varies by family: the one integer tensor
        index = next(v for v in kwargs.values() if isinstance(v, torch.Tensor) and not v.is_floating_point())
    with torch.no_grad():
        counts = torch.bincount(index.reshape(-1), minlength=module.gate_up_proj.shape[0]).float()
        module.routed_tokens = counts if module.routed_tokens is None else module.routed_tokens + counts


def count_expert_tokens(model: nn.Module) -> list[nn.Module]:
    """Make every Hugging Face experts module of ``model`` (whose router keeps no count, unlike mmm's
    :class:`mmm.models.llama.moe.Router`) count the tokens it is handed per expert, for :func:`expert_load`.
    Returns them, in model order (none on a pipeline stage without one)."""
    found = []
    for module in model.modules():
        if hf_experts_problem(module) is None and not hasattr(module, "routed_tokens"):
            module.counting, module.routed_tokens = True, None
            module.register_forward_pre_hook(_count_tokens, with_kwargs=True)
            found.append(module)
    return found


@torch.no_grad()
def expert_load(modules: list[nn.Module], *, data_group=None, device: torch.device) -> dict[str, torch.Tensor]:
    """After a step, on every rank (collectives), for modules :func:`count_expert_tokens` made count: their
    tokens per expert summed over ``data_group`` (data and context parallel: the ranks holding other tokens),
    the counters reset, and the step's record as 0-d tensors, the same on every rank and layout as in one
    process: ``moe_load_min``/``moe_load_max``, the least and the most loaded expert of any layer over the
    layer's mean (every rank's worst, by one MAX reduction: a pipeline stage without experts joins it)."""
    worst = torch.full((2,), -float("inf"), device=device)
    if modules:
        counts = torch.stack(
            [
                m.routed_tokens if m.routed_tokens is not None else torch.zeros(m.gate_up_proj.shape[0], device=device)
                for m in modules
            ]
        )
        if data_group is not None:
            dist.all_reduce(counts, group=data_group)
        load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1)
        worst = torch.stack([-load.min(), load.max()])
        for m in modules:
            m.routed_tokens = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"moe_load_min": -worst[0], "moe_load_max": worst[1]}


# --------------------------------------------------------------------------- a simulated step
def planned_counts(slots: int, experts: int, *, load: float = 1.0) -> list[int]:
    """``slots`` token slots (tokens x top_k) over ``experts``: expert 0 gets ``load`` x the mean (capped at
    all of them), the others share the rest evenly (the first ones one more where it does not divide)."""
    hot = min(slots, round(load * slots / experts))
    rest, others = slots - hot, experts - 1
    if not others:
        return [slots]
    return [hot] + [rest // others + (i < rest % others) for i in range(others)]


class _LocalExperts:
    """``run_experts`` of a Hugging Face experts module without expert parallel: every expert is here."""

    def __call__(self, experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return experts(x, counts)


def _plan_dispatch(hook) -> None:
    """The all-to-all under a ``run_experts`` hook (beneath tensor parallel's, if any) routes by plan."""
    if isinstance(hook, ExpertTensorParallel):
        hook = hook.inner
    if isinstance(hook, ExpertParallel):
        hook.planned = True


def plan_routing(model: nn.Module, *, load: float = 1.0) -> int:
    """Route every mixture of experts in ``model`` by a plan instead of by its router's values, for a
    step simulated on tensors that have none (:mod:`mmm.plan.fake`): each rank sends ``load`` x the
    mean to its first expert and the rest evenly (:func:`planned_counts`), every rank alike (so the
    ep rank holding expert 0 receives ``load`` x its share); routers count nothing. Returns the number
    of mixtures planned (0: the model has none)."""
    plan = functools.partial(planned_counts, load=load)
    found = 0
    for module in model.modules():
        if hasattr(module, "counting"):
            module.counting = False
        if hasattr(module, "planned_counts"):
            module.planned_counts = plan
            found += 1
        _plan_dispatch(getattr(module, "run_experts", None))
        forward = module.__dict__.get("forward")
        if isinstance(forward, _HFExpertsForward):
            _plan_dispatch(forward.hook)
            forward.planned_counts = plan
            found += 1
        elif hf_experts_problem(module) is None and hasattr(module, "gate_up_proj"):
            module.forward = _HFExpertsForward(module, _LocalExperts())  # its own forward reads values
            module.forward.planned_counts = plan
            found += 1
    return found


# --------------------------------------------------------------------------- balancing
def routers(model: nn.Module) -> list[nn.Module]:
    """The modules that count the tokens they route (a ``tokens_per_expert`` buffer), in model order."""
    return [m for m in model.modules() if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor)]


@torch.no_grad()
def balance_experts(modules: list[nn.Module], *, data_group=None, pp_group=None) -> dict[str, torch.Tensor]:
    """After an optimizer step, on every rank (collectives): sum the routers' counts and auxiliary-loss
    values over ``data_group`` (the ranks holding the same layers and other tokens: data and context
    parallel; TP peers route the same tokens and are left out), move each ``expert_bias`` by ``bias_rate``
    towards balance, reset the counters. Returns the step's record as 0-d tensors (read with the step's
    other values), the same on every rank, pipeline stages combined over ``pp_group``:
    ``moe_load_min``/``moe_load_max`` (tokens of the least and the most loaded expert of any layer, over
    the layer's mean), ``moe_aux`` (the auxiliary loss, summed over layers; without one, absent) and
    ``moe_margin`` (the closest any token's k-th and next expert came, bias included: a near-tie there
    may route differently on another layout; absent where each token takes every expert)."""
    counts = torch.stack([m.tokens_per_expert for m in modules])
    aux = torch.stack([m.aux_sum for m in modules])
    margin = torch.stack([m.min_margin for m in modules]).min()
    packed = torch.cat([counts.flatten(), aux.flatten()])
    if data_group is not None:
        dist.all_reduce(packed, group=data_group)
    counts = packed[: counts.numel()].view_as(counts)
    aux = packed[counts.numel() :].view_as(aux)
    for m, c in zip(modules, counts):
        if m.bias_rate > 0:
            m.expert_bias += m.bias_rate * torch.sign(c.mean() - c)
        m.tokens_per_expert.zero_()
        m.aux_sum.zero_()
        m.min_margin.fill_(float("inf"))
    load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1)
    value = (aux[:, 0] / aux[:, 1].clamp(min=1)).sum()
    worst = torch.stack([-load.min(), load.max(), -margin])  # every rank's worst, by one MAX reduction
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if pp_group is not None:  # the stages' layers add up
        dist.all_reduce(value.reshape(1), group=pp_group)
    record = {"moe_load_min": -worst[0], "moe_load_max": worst[1]}
    if all(m.top_k < m.num_experts for m in modules):  # every expert chosen: no next one, no margin (not inf)
        record["moe_margin"] = -worst[2]
    if any(m.aux_weight > 0 for m in modules):
        record["moe_aux"] = value
    return record
