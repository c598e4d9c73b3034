"""Hugging Face ``transformers`` models through mmm: the TP plans of model families, as data.

A transformers model carries its own plan in its config (``base_model_tp_plan``; read it with
:func:`mmm.parallel.tensor.hf_tp_plan`); the plans here are rooted at the causal LM, for
``ParallelSpec(tp_plan=...)``. Nothing here imports transformers.
"""

from __future__ import annotations

# Hugging Face Llama-family causal LMs (LlamaForCausalLM, and Mistral/Qwen2-style models with the
# same module names): the config's ``base_model_tp_plan``, rooted at the causal LM. Embedding, norms
# and the LM head stay unsharded over TP (FSDP still shards them over dp).
HF_LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
