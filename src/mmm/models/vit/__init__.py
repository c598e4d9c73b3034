"""mmm's Vision Transformer (:mod:`.model`, plain single-device code) and its TP plan and shape
checks beside it (:mod:`.tp`)."""

from mmm.models.vit.model import Attention, Block, Mlp, ViT, ViTConfig
from mmm.models.vit.tp import VIT_TP_PLAN, vit_tp_problems

__all__ = ["VIT_TP_PLAN", "Attention", "Block", "Mlp", "ViT", "ViTConfig", "vit_tp_problems"]
