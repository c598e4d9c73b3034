"""Activation checkpointing of transformer blocks: ``full`` or op-level ``selective``."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective")


def _save_matmuls_policy():
    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def wrap_block(block: nn.Module, mode: str) -> nn.Module:
    """``full`` recomputes the whole block in backward; ``selective`` keeps matmul and
    attention outputs and recomputes the cheap element-wise ops (norms, activations)."""
    if mode == "none":
        return block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if mode == "selective":
        return checkpoint_wrapper(
            block,
            preserve_rng_state=False,
            context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls_policy()),
        )
    raise ValueError(f"unknown activation checkpointing mode {mode!r}; choose one of {AC_MODES}")
