"""The Llama recipe's closed-form cost model, per rank of a layout (``python -m mmm.plan``;
:meth:`mmm.models.llama.recipe.LlamaRecipe.estimate`).

Memory (bytes):
  * parameters, gradients, optimizer state: AdamW in fp32 (the ZeRO paper's accounting, as in
    :func:`mmm.parallel.strategy.state_bytes_per_param`) over the parameters this rank's TP shard
    and pipeline stage hold;
  * activations saved for backward, per block with t local tokens (b/dp sequences x s/cp tokens),
    width d, FFN width f, c bytes per element, no activation checkpointing:
    ``(8/tp + 2) t d c + 4 t f c / tp`` (two RMSNorms keep input, normalised input and the
    gathered output; attention keeps q, k, v and its output; the SwiGLU keeps four f-wide tensors),
    plus the final norm and the logits; context parallel adds the ring's per-chunk scores. Under
    pipeline parallel, microbatches in flight (all m for gpipe, up to pp for 1F1B) multiply it; under
    gradient accumulation (``--microbatches`` without a pipeline) one microbatch's is held.
    With ``--ac full`` a block keeps only its input (one block is recomputed at a time).

Communication (payload bytes per step, as :class:`mmm.measure.CommCounter` counts them), by the
process group that carries it (a flattened view over one axis is that axis):
  * FSDP: all-gather of the unsharded parameters in forward, again in backward for resharded
    blocks (under PP, by default, once per step: a stage keeps them gathered over its microbatches;
    with --reshard-after-forward true once per microbatch forward, once for backward), reduce-scatter of fp32
    gradients; HSDP adds an all-reduce of the gradient shard
    over dp_replicate; DDP all-reduces fp32 gradients; under gradient accumulation FSDP's traffic is
    once per microbatch, HSDP's all-reduce and DDP's once per step (ZeRO's is counted once: DeepSpeed's
    own accumulation is not modelled);
  * ZeRO-1/2/3: gradients reduced (all-reduce / reduce-scatter) and parameters all-gathered; ZeRO-3
    gathers again in backward only past DeepSpeed's ``stage3_max_live_parameters`` (1e9);
  * TP with sequence parallel: an all-gather and a reduce-scatter of a (t, d) activation around
    attention and around the MLP, forward and backward (8 per block), 4 more for embedding and output;
  * CP: ring attention passes k and v (cp - 1) times forward and their gradients back, send and receive;
  * PP: each stage boundary sends activations forward and gradients back, per microbatch.

Tests compare these with measured figures (``--measure``); see tests/test_plan.py for tolerances.
"""

from __future__ import annotations

from mmm.parallel.compose import shards_parameters
from mmm.parallel.mesh import FLAT_VIEWS, ParallelDims
from mmm.parallel.pipeline import stage_ids, stage_layer_ranges
from mmm.parallel.strategy import state_bytes_per_param

DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def _dims(config, world: int):
    return ParallelDims(world_size=world, **config.parallel.degrees)


def _stage_blocks(config, dims) -> list[tuple[int, bool, bool]]:
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


def estimate_memory(config, world: int) -> dict[str, float]:
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
        elif par.microbatches:  # gradient accumulation: one microbatch's at a time
            act = act / par.microbatches
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


def estimate_comm(config, world: int) -> dict[str, float]:
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
        # gradient accumulation: every microbatch gathers and reduce-scatters (HSDP's all-reduce waits)
        passes = (par.microbatches or 1) if dims.pp == 1 else 1
        add(shard_view, (params + regather) * c * passes)  # all-gathers in param dtype
        add(shard_view, params * 4 * passes)  # reduce-scatter of fp32 gradients
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
