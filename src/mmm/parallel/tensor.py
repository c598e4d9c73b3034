"""Tensor + sequence parallelism (TP/SP) plans, applied from outside the model.

The Llama plan follows PyTorch's TP tutorial: attention and feed-forward projections are
column-wise then row-wise sharded (heads split over TP ranks), norms run sequence-parallel
on a sequence-sharded residual stream, the embedding is row-wise sharded and hands out a
sequence-sharded activation, and the output projection is column-wise sharded over the
vocabulary so that the loss can be computed without gathering logits (loss parallel).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


def tp_problems(*, tp: int, n_heads: int, n_kv_heads: int, vocab_size: int, seq_len: int,
                sequence_parallel: bool = True) -> list[str]:
    """What a TP degree requires of a transformer's shapes, each problem naming the values."""
    if tp <= 1:
        return []
    out = []
    if n_heads % tp:
        out.append(f"--n-heads {n_heads} is not divisible by tp={tp}; heads are split over TP ranks "
                   f"(use tp in {{{', '.join(str(d) for d in range(1, n_heads + 1) if n_heads % d == 0)}}})")
    if n_kv_heads % tp:
        out.append(f"--n-kv-heads {n_kv_heads} is not divisible by tp={tp}; key/value heads are split over TP ranks")
    if vocab_size % tp:
        out.append(f"--vocab-size {vocab_size} is not divisible by tp={tp}; embedding and output are vocab-sharded")
    if sequence_parallel and seq_len % tp:
        out.append(f"--seq-len {seq_len} is not divisible by tp={tp}; sequence parallelism splits the sequence")
    return out


def apply_tp_llama(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True) -> nn.Module:
    """Shard a :class:`mmm.models.llama.Llama` over ``tp_mesh`` (in place) with sequence parallelism."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # a pipeline stage holds only some of these (mmm.parallel.pipeline.split_model sets the others to None)
    top_plan = {name: style for name, style in top_plan.items() if getattr(model, name, None) is not None}
    if top_plan:
        parallelize_module(model, tp_mesh, top_plan)
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    return model


def loss_parallel_context(enabled: bool):
    """``torch.distributed.tensor.parallel.loss_parallel()`` when TP shards the logits, else a no-op.

    Wrap both the loss and its backward in it.
    """
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def vit_tp_problems(*, tp: int, num_heads: int) -> list[str]:
    if tp > 1 and num_heads % tp:
        return [f"--num-heads {num_heads} is not divisible by tp={tp}; heads are split over TP ranks"]
    return []


def apply_tp_vit(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard a :class:`mmm.models.vit.ViT`'s blocks over ``tp_mesh``: q/k/v and fc1 column-wise,
    proj and fc2 row-wise (heads and MLP width split; activations between blocks replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)
    return model
