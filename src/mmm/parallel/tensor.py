"""Tensor + sequence parallelism (TP/SP): plans as data, applied from outside the model.

A plan maps module-name patterns to a ``ParallelStyle`` (or its short name), as Hugging Face
configs ship them: ``"layers.*.attention.wq": "colwise"``. ``*`` stands for one name (a block
index). :func:`apply_tp_plan` checks every pattern against the model's module names before
anything is sharded: a pattern that matches nothing is an error, not a silent no-op.

Short names: ``colwise``, ``rowwise`` (its output replicated), ``sequence_parallel``,
``rowwise_seq`` (row-wise, output sharded along the sequence: the end of an SP region).

Plans of mmm's own models live beside them (``mmm.models.llama.llama_tp_plan``,
``mmm.models.vit.VIT_TP_PLAN``); a Hugging Face model carries its own (:func:`hf_tp_plan`; the Llama
family's rooted at the causal LM: ``mmm.models.hf.HF_LLAMA_TP_PLAN``).
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from mmm.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

STYLE_NAMES = ("colwise", "rowwise", "rowwise_seq", "sequence_parallel")


def style(name_or_style: Any):
    """A ``ParallelStyle`` from its short name (a ``ParallelStyle`` passes through)."""
    if not isinstance(name_or_style, str):
        return name_or_style
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "sequence_parallel": SequenceParallel,
        "rowwise_seq": lambda: RowwiseParallel(output_layouts=Shard(1)),
    }
    if name_or_style not in styles:
        raise UsageError(
            f"unknown TP style {name_or_style!r}; use one of {', '.join(STYLE_NAMES)} or a "
            "torch.distributed.tensor.parallel.ParallelStyle"
        )
    return styles[name_or_style]()


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def resolve_plan(model: nn.Module, plan: Mapping[str, Any], *, allow_missing: bool = False) -> dict[str, Any]:
    """``{module name: style}`` for every module a pattern of ``plan`` names.

    A pattern that names no module raises a one-line error listing them (``allow_missing``: skip
    it, for a pipeline stage that holds only some of the model). Modules replaced by
    ``nn.Identity`` (dropped from a pipeline stage) do not count.
    """
    names = [n for n, m in model.named_modules() if n and not isinstance(m, nn.Identity)]
    out: dict[str, Any] = {}
    missing = []
    for pattern, st in plan.items():
        hits = [n for n in names if _matches(pattern, n)]
        if not hits:
            missing.append(pattern)
        for n in hits:
            out[n] = st
    if missing and not allow_missing:
        close = closest_patterns(missing, names)
        layers = _as_patterns(n for n, m in model.named_modules() if n and isinstance(m, (nn.Linear, nn.Embedding)))
        raise UsageError(
            f"TP plan pattern(s) {', '.join(repr(p) for p in missing)} match no module of "
            f"{type(model).__name__}; "
            + (
                f"did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else f"its linear and embedding layers (what a plan splits): {', '.join(map(repr, layers[:10]))}"
                + (", ..." if len(layers) > 10 else "")
                if layers
                else f"its modules look like {', '.join(names[:6])}{', ...' if len(names) > 6 else ''}"
                if names
                else "it has no submodules to shard (a plan names submodules, e.g. 'layers.*.wq')"
            )
        )
    return out


def _as_patterns(names) -> list[str]:
    """Module names as patterns, each block's index as ``*`` (``layers.0.wq``, ``layers.1.wq`` -> ``layers.*.wq``)."""
    return list(dict.fromkeys(re.sub(r"(?:(?<=\.)|^)\d+(?=\.|$)", "*", n) for n in names))


def closest_patterns(patterns: list[str], names: list[str]) -> list[str]:
    """The module names most like ``patterns``, as patterns (a block's index as ``*``): two for each, four in all."""
    shapes = _as_patterns(names)
    found: list[str] = []
    for pattern in patterns:
        found += [c for c in difflib.get_close_matches(pattern, shapes, n=2, cutoff=0.75) if c not in found]
    return found[:4]


def apply_tp_plan(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Any], *, allow_missing: bool = False
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` by a plan of module-name patterns (see the module doc)."""
    from torch.distributed.tensor.parallel import parallelize_module

    resolved = resolve_plan(model, plan, allow_missing=allow_missing)
    parallelize_module(model, tp_mesh, {name: style(st) for name, st in resolved.items()})
    return model


# --------------------------------------------------------------------------- Hugging Face plans
HF_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", "moe_tp_experts", "packed_colwise")
"""The styles of a Hugging Face TP plan mmm maps (``packed_colwise`` and ``rowwise`` on the parameters of a
``moe_tp_experts`` module: the experts' own split, :mod:`mmm.parallel.experts`)."""
STYLE_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"


def _hf_base_plan(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not base:
        raise UsageError(f"{type(model).__name__}'s config carries no base_model_tp_plan; pass a tp_plan")
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and getattr(model, prefix, None) is not None:
        base = {f"{prefix}.{k}": v for k, v in base.items()}
    return base


def hf_tp_plan(model: nn.Module) -> dict[str, Any]:
    """The TP plan a Hugging Face model's config carries (``base_model_tp_plan``), rooted at ``model``.

    ``colwise``/``rowwise`` as themselves; ``replicated_with_grad_allreduce`` (q_norm/k_norm on
    (batch, seq, heads, head_dim) shards of the heads) as ``SequenceParallel(sequence_dim=2)``: weights
    replicated, their gradient summed over the TP ranks; a ``moe_tp_experts`` module and its parameters'
    entries are left to the experts plan (:func:`hf_experts_plan`). A family's plan names every kind of
    block it has: patterns that match no module of this model are dropped. Any other style is refused by
    name."""
    from torch.distributed.tensor.parallel import SequenceParallel

    base = _hf_base_plan(model)
    unknown = sorted({v for v in base.values() if v not in HF_STYLES})
    if unknown:
        raise UsageError(
            f"{type(model).__name__}'s TP plan uses style(s) {', '.join(unknown)}, which mmm does not "
            "map; pass your own tp_plan"
        )
    experts = [p for p, v in base.items() if v == "moe_tp_experts"]
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, Any] = {}
    for pattern, st in base.items():
        if pattern in experts or any(pattern.startswith(e + ".") for e in experts):
            continue
        if st == "packed_colwise":
            raise UsageError(f"{type(model).__name__}'s TP plan packs {pattern!r} outside an experts module")
        if any(_matches(pattern, n) for n in names):
            plan[pattern] = (
                SequenceParallel(sequence_dim=2, use_local_output=True) if st == STYLE_GRAD_ALLREDUCE else st
            )
    return plan


def hf_experts_plan(model: nn.Module) -> dict[str, str]:
    """The experts modules a Hugging Face model's TP plan splits (``moe_tp_experts``), as an experts plan
    (:mod:`mmm.parallel.experts`), rooted at ``model``; {} when it has none."""
    config = getattr(model, "config", None)
    if not getattr(config, "base_model_tp_plan", None):
        return {}
    return {p: "experts" for p, v in _hf_base_plan(model).items() if v == "moe_tp_experts"}


# --------------------------------------------------------------------------- loss
def loss_parallel_context(enabled: bool):
    """``torch.distributed.tensor.parallel.loss_parallel()`` when TP shards the logits, else a no-op.

    Wrap both the loss and its backward in it.
    """
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
