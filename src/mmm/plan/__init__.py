"""Plan a parallel layout: every (pp, dp_replicate, dp_shard, cp, tp, strategy) for N ranks, why
the invalid ones are invalid, and per-rank memory and communication estimates for the valid ones.

An application of the library (it asks the fsdp_tp trainer which layouts are valid). Used by
``python -m mmm.plan`` (:mod:`mmm.plan.cli`) and ``benchmarks/sweep.py``; usable as a function::

    from mmm.plan import plan
    for c in plan(8, dim=512, n_layers=8, seq_len=256, batch_size=32):
        print(c.label, c.valid and c.memory["total_bytes"], c.problems)

Validity is the fsdp_tp trainer's own check (:func:`mmm.training.llama.problems`), so the
planner and the trainer never disagree. Estimates are for that trainer's Llama model, per rank
(the busiest rank where ranks differ):

Memory (bytes):
  * parameters, gradients, optimizer state: AdamW in fp32 (the ZeRO paper's accounting, as in
    :func:`mmm.parallel.strategy.state_bytes_per_param`) over the parameters this rank's TP shard
    and pipeline stage hold;
  * activations saved for backward, per block with t local tokens (b/dp sequences x s/cp tokens),
    width d, FFN width f, c bytes per element, no activation checkpointing:
    ``(8/tp + 2) t d c + 4 t f c / tp`` (two RMSNorms keep input, normalised input and the
    gathered output; attention keeps q, k, v and its output; the SwiGLU keeps four f-wide tensors),
    plus the final norm and the logits; context parallel adds the ring's per-chunk scores. Under
    pipeline parallel, microbatches in flight (all m for gpipe, up to pp for 1F1B) multiply it.
    With ``--ac full`` a block keeps only its input (one block is recomputed at a time).

Communication (payload bytes per step, as :class:`mmm.measure.CommCounter` counts them), by the
process group that carries it (a flattened view over one axis is that axis):
  * FSDP: all-gather of the unsharded parameters in forward, again in backward for resharded
    blocks (under PP, by default, once per step: a stage keeps them gathered over its microbatches;
    with --reshard-after-forward true once per microbatch forward, once for backward), reduce-scatter of fp32
    gradients; HSDP adds an all-reduce of the gradient shard
    over dp_replicate; DDP all-reduces fp32 gradients;
  * ZeRO-1/2/3: gradients reduced (all-reduce / reduce-scatter) and parameters all-gathered; ZeRO-3
    gathers again in backward only past DeepSpeed's ``stage3_max_live_parameters`` (1e9);
  * TP with sequence parallel: an all-gather and a reduce-scatter of a (t, d) activation around
    attention and around the MLP, forward and backward (8 per block), 4 more for embedding and output;
  * CP: ring attention passes k and v (cp - 1) times forward and their gradients back, send and receive;
  * PP: each stage boundary sends activations forward and gradients back, per microbatch.

Tests compare these with measured figures (``--measure``); see tests/test_plan.py for tolerances.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from mmm.errors import UsageError
from mmm.parallel.compose import shards_parameters
from mmm.parallel.mesh import FLAT_VIEWS, ParallelDims
from mmm.parallel.pipeline import stage_ids, stage_layer_ranges
from mmm.parallel.strategy import STRATEGIES, state_bytes_per_param
from mmm.training.config import Config, ParallelConfig, RunConfig
from mmm.training.llama import LlamaTrainConfig, problems

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


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
        return "-".join(f"{short[a]}{self.degrees[a]}" for a in AXES) + f"-{self.strategy}{mb}"

    @property
    def flags(self) -> list[str]:
        """The trainer flags that select this layout."""
        out = []
        for a in AXES:
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


def trainer_config(**overrides) -> Config[LlamaTrainConfig]:
    """The fsdp_tp trainer's defaults with ``overrides`` (field names: ``n_layers=8``, ``dtype="bf16"``,
    ``measure=True``), each given to the config that has it."""
    sections = {"train": LlamaTrainConfig, "parallel": ParallelConfig, "run": RunConfig}
    given: dict[str, dict[str, Any]] = {name: {} for name in sections}
    for key, value in overrides.items():
        owner = next((name for name, cls in sections.items() if key in {f.name for f in fields(cls)}), None)
        if owner is None:
            raise TypeError(f"unknown trainer option {key}")
        given[owner][key] = value
    return Config(**{name: cls(**given[name]) for name, cls in sections.items()})


def plan(
    world: int,
    config: Config[LlamaTrainConfig] | None = None,
    *,
    strategies=None,
    fixed: dict[str, int] | None = None,
    **overrides,
) -> list[Combo]:
    """Every layout of ``world`` ranks (valid first, in mesh order), with estimates for the valid ones.

    ``config``: the trainer's (default: its defaults, with ``overrides``, see :func:`trainer_config`);
    its degrees and strategy are what varies. ``strategies``: the data-parallel strategies to consider
    (default all); ``fixed``: degrees to hold, e.g. ``{"tp": 2}``.
    """
    if not isinstance(world, int) or world < 1:
        raise UsageError(f"--world {world} must be a positive number of ranks (e.g. --world 4)")
    config = config if config is not None else trainer_config(**overrides)
    strategies = list(strategies or STRATEGIES)
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise UsageError(f"unknown strategy {', '.join(map(repr, bad))}; choose from: {', '.join(STRATEGIES)}")
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    out: list[Combo] = []
    for shape in _factorizations(world, len(AXES)):
        degrees = dict(zip(AXES, shape))
        if any(degrees[k] != v for k, v in fixed.items()):
            continue
        for strategy in strategies:
            trial = replace(config, parallel=replace(config.parallel, **degrees, strategy=strategy))
            found = problems(trial, world)
            if not found and strategy == "ddp" and degrees["dp_replicate"] > 1:
                found = [
                    f"same as dp_shard={degrees['dp_replicate'] * degrees['dp_shard']} with ddp: DDP "
                    "replicates over the flattened dp group, so dp_replicate changes nothing"
                ]
            combo = Combo(degrees, strategy, found)
            if combo.valid:
                combo.memory = estimate_memory(trial, world)
                combo.comm = estimate_comm(trial, world)
            out.append(combo)
    out.sort(key=lambda c: not c.valid)
    if fixed and not out:
        raise UsageError(
            f"no layout of {world} ranks has {', '.join(f'{k}={v}' for k, v in fixed.items())}: "
            f"the degrees must multiply to {world}"
        )
    return out


# --------------------------------------------------------------------------- the model's shapes
def _dims(config: Config, world: int):
    return ParallelDims(world_size=world, **config.parallel.degrees)


def _stage_blocks(config: Config[LlamaTrainConfig], dims) -> list[tuple[int, bool, bool]]:
    """(blocks, has embedding, has output) of every pipeline rank (its stages together)."""
    n_layers, par = config.train.n_layers, config.parallel
    if dims.pp == 1:
        return [(n_layers, True, True)]
    num_stages = dims.pp * par.stages_per_rank
    ranges = stage_layer_ranges(n_layers, num_stages, par.split_points)
    out = []
    for r in range(dims.pp):
        ids = stage_ids(r, dims.pp, par.stages_per_rank)
        out.append((sum(ranges[i][1] - ranges[i][0] for i in ids), 0 in ids, num_stages - 1 in ids))
    return out


def _rank_params(cfg, tp: int, blocks: int, first: bool, last: bool) -> tuple[float, float]:
    """(all, in blocks) parameters one rank holds before data-parallel sharding."""
    d, f, hd = cfg.dim, cfg.ffn_hidden, cfg.head_dim
    block = (d * cfg.n_heads * hd * 2 + 2 * d * cfg.n_kv_heads * hd + 3 * d * f) / tp + 2 * d
    total = blocks * block
    if first:
        total += cfg.vocab_size * d / tp
    if last:
        total += cfg.vocab_size * d / tp + d
    return total, blocks * block


def estimate_memory(config: Config[LlamaTrainConfig], world: int) -> dict[str, float]:
    """Per-rank bytes (busiest rank) of parameters, gradients, optimizer state and activations."""
    cfg, dims, par, batch = config.train.model_config(), _dims(config, world), config.parallel, config.train.batch_size
    p, g, o = state_bytes_per_param(par.strategy, dims)
    c = DTYPE_BYTES[par.dtype]
    t = batch // dims.dp * cfg.seq_len // dims.cp  # tokens per rank per step
    d, f, tp = cfg.dim, cfg.ffn_hidden, dims.tp
    kvw = cfg.n_kv_heads * cfg.head_dim  # k and v width: grouped-query attention keeps them narrower
    norms_ffn = 2 * (2 / tp + 1) * t * d * c + 4 * t * f * c / tp
    if dims.cp == 1:
        attention = (2 * d + 2 * kvw) * t * c / tp  # q, k, v (rotated; k/v n_kv_heads wide) and the output
    else:  # ring attention: q, every rotated k/v pair, merged outputs, and fp32 scores + probabilities per pair
        cp, heads, chunk = dims.cp, cfg.n_heads / tp, cfg.seq_len // dims.cp // 2
        pairs = 2 * cp + 1  # (query chunk, key chunk) pairs a rank computes under causal load balancing
        attention = (2 * d + 4 * cp * kvw) * t * c / tp + pairs * 2 * (batch // dims.dp) * heads * chunk**2 * 4
    per_block = norms_ffn + attention
    if par.ac == "full":
        per_block = t * d * c  # a checkpointed block keeps only its input
    out_layers = (2 / tp + 1) * t * d * c + t * cfg.vocab_size * 4 / tp
    best: dict[str, float] = {}
    for blocks, first, last in _stage_blocks(config, dims):
        params, _ = _rank_params(cfg, tp, blocks, first, last)
        act = blocks * per_block + (out_layers if last else 0.0)
        if par.ac == "full":
            act += norms_ffn + attention  # the block being recomputed
        if dims.pp > 1:
            m = par.microbatches or dims.pp
            in_flight = m if par.pp_schedule == "gpipe" else min(m, dims.pp)
            act = act / m * in_flight
        row = {"param_bytes": p * params, "grad_bytes": g * params, "optim_bytes": o * params, "activation_bytes": act}
        row["state_bytes"] = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
        row["total_bytes"] = row["state_bytes"] + act
        if not best or row["total_bytes"] > best["total_bytes"]:
            best = row
    return best


def group_name(view: str, dims) -> str:
    """The name :meth:`mmm.parallel.Mesh.named_groups` gives the group of ``view`` (a flattened
    view over a single enabled axis is that axis)."""
    if view in FLAT_VIEWS:
        on = [a for a in FLAT_VIEWS[view] if getattr(dims, a) > 1]
        if len(on) == 1:
            return on[0]
        for name, parts in FLAT_VIEWS.items():  # views over the same axes share one group: the first name
            if [a for a in parts if getattr(dims, a) > 1] == on:
                return name
    return view


def estimate_comm(config: Config[LlamaTrainConfig], world: int) -> dict[str, float]:
    """Payload bytes per step by process group, for the busiest rank."""
    cfg, dims, par = config.train.model_config(), _dims(config, world), config.parallel
    c = DTYPE_BYTES[par.dtype]
    b = config.train.batch_size // dims.dp
    t = b * cfg.seq_len // dims.cp
    d, tp = cfg.dim, dims.tp
    stages = _stage_blocks(config, dims)
    blocks, first, last = max(stages, key=lambda s: _rank_params(cfg, tp, *s)[0])
    params, block_params = _rank_params(cfg, tp, blocks, first, last)
    out: dict[str, float] = {}

    def add(view: str, nbytes: float) -> None:
        if nbytes:
            key = group_name(view, dims)
            out[key] = out.get(key, 0.0) + nbytes

    strategy = par.strategy
    dp_view = "dp_cp" if dims.cp > 1 else "dp"
    if strategy in ("fsdp", "hsdp") and shards_parameters(dims, strategy):
        shard_view = "dp_shard" if strategy == "hsdp" else dp_view
        reshard = {"auto": "blocks", "true": "all", "false": "none"}[par.reshard_after_forward]
        if dims.pp > 1 and par.reshard_after_forward == "auto":
            reshard = "none"  # a stage keeps its parameters gathered over its microbatches
        regather = {"blocks": block_params, "all": params, "none": 0.0}[reshard]
        if dims.pp > 1 and reshard != "none":  # every microbatch's forward gathers; backward once more
            regather = params * (par.microbatches or dims.pp)
        add(shard_view, (params + regather) * c)  # all-gathers in param dtype
        add(shard_view, params * 4)  # reduce-scatter of fp32 gradients
        if strategy == "hsdp":
            add("dp_replicate", params * 4 / dims.dp_shard)
    elif strategy == "ddp" and dims.dp > 1:
        add("dp", params * 4)
    elif strategy in ("zero1", "zero2", "zero3") and dims.dp > 1:
        # gradients reduced, parameters gathered; ZeRO-3 re-gathers in backward only when the model
        # exceeds DeepSpeed's stage3_max_live_parameters (1e9 by default)
        regather = strategy == "zero3" and cfg.num_params() > 1e9
        add("dp", params * 4 * (3 if regather else 2))
    if dims.tp > 1:
        add("tp", (8 * blocks + 2 * first + 2 * last) * t * d * c)
    if dims.cp > 1:
        add("cp", 8 * (dims.cp - 1) * blocks * t * cfg.n_kv_heads * cfg.head_dim / tp * c)  # k/v unexpanded
    if dims.pp > 1:  # per stage and neighbour: activations one way, their gradients back
        num_stages = dims.pp * par.stages_per_rank
        links = max(
            sum((i > 0) + (i < num_stages - 1) for i in stage_ids(r, dims.pp, par.stages_per_rank))
            for r in range(dims.pp)
        )
        add("pp", 2 * links * t * d / tp * c)
    return out
