"""mmm's Vision Transformer (:mod:`.model`, plain single-device code) and, beside it, its TP plan and shape
checks (:mod:`.tp`), which its names here load on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmm.models.vit.model import Attention, Block, Mlp, ViT, ViTConfig

if TYPE_CHECKING:  # pragma: no cover
    from mmm.models.vit.tp import VIT_TP_PLAN, vit_tp_problems


def __getattr__(name: str):
    if name in ("VIT_TP_PLAN", "vit_tp_problems"):
        return getattr(importlib.import_module("mmm.models.vit.tp"), name)
    raise AttributeError(f"module 'mmm.models.vit' has no attribute {name!r}")


__all__ = ["VIT_TP_PLAN", "Attention", "Block", "Mlp", "ViT", "ViTConfig", "vit_tp_problems"]
