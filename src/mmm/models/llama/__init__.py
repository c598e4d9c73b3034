"""mmm's Llama (:mod:`.model`, plain single-device code) and, beside it, its parts of the library: the TP
plan and shape checks (:mod:`.tp`), the context-parallel hook (:mod:`.context`) and the Hugging Face
checkpoint mapping (:mod:`.hf`). Importing the model loads none of them (nor :mod:`mmm.parallel`); their
names here load them on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from mmm.models.llama.model import (
    Attention,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    TransformerBlock,
    apply_rope,
    causal_sdpa,
    rope_table,
)

# the library's parts for this model, by the module that holds them
_PARTS = {
    "apply_cp_llama": "context",
    "export_hf_llama": "hf",
    "hf_llama_config": "hf",
    "hf_llama_sources": "hf",
    "llama_config_from_hf": "hf",
    "load_hf_llama": "hf",
    "llama_tp_plan": "tp",
    "tp_problems": "tp",
}

if TYPE_CHECKING:  # pragma: no cover
    from mmm.models.llama.context import apply_cp_llama
    from mmm.models.llama.hf import (
        export_hf_llama,
        hf_llama_config,
        hf_llama_sources,
        llama_config_from_hf,
        load_hf_llama,
    )
    from mmm.models.llama.tp import llama_tp_plan, tp_problems


def __getattr__(name: str):
    if name in _PARTS:
        return getattr(importlib.import_module(f"mmm.models.llama.{_PARTS[name]}"), name)
    raise AttributeError(f"module 'mmm.models.llama' has no attribute {name!r}")


__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_cp_llama",
    "apply_rope",
    "causal_sdpa",
    "export_hf_llama",
    "hf_llama_config",
    "hf_llama_sources",
    "llama_config_from_hf",
    "llama_tp_plan",
    "load_hf_llama",
    "rope_table",
    "tp_problems",
]
