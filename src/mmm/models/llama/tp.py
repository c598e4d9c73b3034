"""Llama's tensor + sequence parallel plan, as data for :func:`mmm.parallel.parallelize`, and what a
TP degree requires of its shapes.

The plan follows PyTorch's TP tutorial: attention and feed-forward projections are column-wise
then row-wise sharded (heads split over TP ranks), norms run sequence-parallel on a
sequence-sharded residual stream, the embedding is row-wise sharded and hands out a
sequence-sharded activation, and the output projection is column-wise sharded over the
vocabulary so that the loss can be computed without gathering logits (loss parallel).
"""

from __future__ import annotations

from typing import Any

from mmm.errors import API, Spelling


def llama_tp_plan(*, loss_parallel: bool = True, moe: bool = False, shared: bool = False) -> dict[str, Any]:
    """TP + sequence parallel plan of :class:`mmm.models.llama.Llama` (patterns from the model root);
    ``moe``: its blocks hold a mixture of experts (``shared``: with a shared expert) in place of the dense
    feed-forward. The mixture gets its input gathered over the sequence (every TP rank routes the same
    tokens) and gives back its whole output, cut along the sequence again; the shared expert is split as
    the dense feed-forward is; the routed experts' width is split by :mod:`mmm.parallel.experts` (the
    experts plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
    )

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": "sequence_parallel",
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise_seq",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise_seq",
        "layers.*.feed_forward.w3": "colwise",
    }
    if not moe:
        return plan
    plan = {k: v for k, v in plan.items() if "feed_forward" not in k}
    plan["layers.*.moe"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(),),
        desired_output_layouts=(Shard(1),),
        use_local_output=True,  # the residual stream is this rank's part of the sequence, as a plain tensor
    )
    if shared:
        plan |= {"layers.*.moe.shared.w1": "colwise", "layers.*.moe.shared.w3": "colwise"}
        plan["layers.*.moe.shared.w2"] = "rowwise"
    return plan


def tp_problems(
    *,
    tp: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    seq_len: int,
    sequence_parallel: bool = True,
    spell: Spelling = API,
    world: int | None = None,
) -> list[str]:
    """What a TP degree requires of Llama's shapes (:class:`~mmm.models.llama.LlamaConfig` fields),
    each problem naming the values; ``world``: the ranks, so that the degrees suggested also divide it."""
    if tp <= 1:
        return []
    out = []
    if n_heads % tp:
        fits = [d for d in range(1, n_heads + 1) if n_heads % d == 0 and (world is None or world % d == 0)]
        out.append(
            f"{spell('n_heads', n_heads)} is not divisible by tp={tp}; heads are split over TP ranks "
            f"(use tp in {{{', '.join(map(str, fits))}}}{f' on {world} ranks' if world else ''})"
        )
    if n_kv_heads % tp:
        out.append(
            f"{spell('n_kv_heads', n_kv_heads)} is not divisible by tp={tp}; key/value heads are split over TP ranks"
        )
    if vocab_size % tp:
        out.append(
            f"{spell('vocab_size', vocab_size)} is not divisible by tp={tp}; embedding and output are vocab-sharded"
        )
    if sequence_parallel and seq_len % tp:
        out.append(f"{spell('seq_len', seq_len)} is not divisible by tp={tp}; sequence parallelism splits the sequence")
    return out
