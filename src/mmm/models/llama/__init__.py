"""mmm's Llama (:mod:`.model`, plain single-device code) and its recipes beside it: the TP plan and
shape checks (:mod:`.tp`), the context-parallel hook (:mod:`.context`) and the Hugging Face
checkpoint mapping (:mod:`.hf`)."""

from mmm.models.llama.context import apply_cp_llama
from mmm.models.llama.hf import export_hf_llama, hf_llama_config, hf_llama_sources, llama_config_from_hf, load_hf_llama
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
from mmm.models.llama.tp import llama_tp_plan, tp_problems

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
