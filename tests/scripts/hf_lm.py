"""A user's factory for a tiny transformers Llama (random weights, no download), for `python -m mmm.verify
--model hf_lm:build --tp 2` with no --tp-plan: the plan its config carries is used."""

from transformers import LlamaConfig, LlamaForCausalLM


def build():
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(config)
