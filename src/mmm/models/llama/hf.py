"""mmm's Llama from and to a Hugging Face Llama checkpoint (``LlamaForCausalLM``, safetensors).

    from mmm.models.llama import Llama, llama_config_from_hf, load_hf_llama
    cfg = llama_config_from_hf("path/to/llama")              # config.json -> mmm's LlamaConfig
    with meta_init():
        model = Llama(cfg)
    model = parallelize(model, mesh, spec, device=dev, seed=0)
    load_hf_llama(model, "path/to/llama")                    # model.safetensors (or its index + shards)

Names are mapped from Hugging Face's Llama layout to mmm's (``model.layers.0.self_attn.q_proj.weight``
-> ``layers.0.attention.wq.weight``), and the query/key projections are permuted from HF's rotary
layout (rotate-half) to mmm's (adjacent pairs); each rank reads only its shards
(:func:`mmm.parallel.hf_checkpoint.load_safetensors`). The way out, :func:`export_hf_llama`, is the
inverse: every rank takes part, rank 0 writes ``config.json`` + ``model.safetensors`` that
transformers' ``LlamaForCausalLM.from_pretrained`` loads, and that :func:`load_hf_llama` reads back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from mmm.errors import UsageError
from mmm.models.llama.model import LlamaConfig
from mmm.parallel.hf_checkpoint import Source, export_safetensors, load_safetensors, read_hf_config, tensor_files

# mmm Llama name (after "layers.N.") -> HF name (after "model.layers.N.")
_BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# a Hugging Face config's rope_type "llama3" (Llama 3.1): mmm.models.llama.model.llama3_frequencies
LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def llama_config_from_hf(path: str | Path, *, seq_len: int | None = None) -> LlamaConfig:
    """mmm's :class:`~mmm.models.llama.LlamaConfig` for the Hugging Face Llama in ``path``
    (its config.json); ``seq_len`` (default: max_position_embeddings) sizes the rotary table."""
    hf = read_hf_config(path)
    if hf.get("model_type") != "llama":
        raise UsageError(
            f"{path} holds a {hf.get('model_type')!r} model; this loader reads Llama checkpoints (model_type 'llama')"
        )
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    missing = [k for k in required if not isinstance(hf.get(k), int) or hf[k] <= 0]
    if missing:
        raise UsageError(
            f"{path}: its config.json has no {', '.join(missing)} (a positive integer each); a Hugging Face Llama "
            "config names them all"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems, scaling = [], None
    if rope_type == "llama3":
        scaling = {k: rope.get(k) for k in LLAMA3_ROPE}
        bad = [k for k, v in scaling.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0]
        if bad:
            problems.append(f"rope_type 'llama3' needs {', '.join(bad)} (positive numbers)")
        elif scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            problems.append("rope_type 'llama3' needs high_freq_factor > low_freq_factor")
    elif rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (mmm's Llama has plain rotary embeddings, or Llama 3.1's 'llama3')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true (mmm's Llama has no biases)")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim {hf['head_dim']} != hidden_size / num_attention_heads = {dim // heads}")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf['hidden_act']!r} (mmm's Llama uses silu)")
    if problems:
        raise UsageError(f"{path}: cannot load into mmm's Llama: {'; '.join(problems)}")
    return LlamaConfig(
        dim=dim,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        vocab_size=hf["vocab_size"],
        seq_len=seq_len or hf.get("max_position_embeddings", 2048),
        ffn_hidden_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
    )


def hf_llama_sources(cfg: LlamaConfig, *, tied: bool = False) -> dict[str, Source]:
    """mmm Llama parameter name -> where it is in a Hugging Face Llama checkpoint."""
    out = {k: Source(v) for k, v in _TOP_NAMES.items()}
    if tied:
        out["output.weight"] = Source("model.embed_tokens.weight")
    for i in range(cfg.n_layers):
        for mine, theirs in _BLOCK_NAMES.items():
            rotary = cfg.head_dim if mine in ("attention.wq.weight", "attention.wk.weight") else None
            out[f"layers.{i}.{mine}"] = Source(f"model.layers.{i}.{theirs}", rotary)
    return out


def load_hf_llama(model: nn.Module, path: str | Path) -> None:
    """Load the Hugging Face Llama checkpoint at ``path`` into mmm's Llama ``model`` (sharded or not;
    under pipeline parallel, this rank's stages). A tied checkpoint (no ``lm_head``) fills the output
    layer from the embedding: mmm's Llama keeps them as two parameters."""
    path = Path(path)
    hf = read_hf_config(path)
    cfg = getattr(model, "cfg", None) or llama_config_from_hf(path)
    tied = bool(hf.get("tie_word_embeddings")) and "lm_head.weight" not in tensor_files(path)
    load_safetensors(model, path, sources=hf_llama_sources(cfg, tied=tied))


def hf_llama_config(cfg: LlamaConfig, *, tied: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """transformers' ``LlamaConfig`` (as config.json) of mmm's :class:`~mmm.models.llama.LlamaConfig`:
    the inverse of :func:`llama_config_from_hf` (``max_position_embeddings`` is ``seq_len``)."""
    rope_type = "llama3" if cfg.rope_scaling else "default"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # rope_parameters for transformers >= 5, rope_theta (and rope_scaling) for the releases before
        "rope_parameters": {"rope_type": rope_type, "rope_theta": float(cfg.rope_theta), **(cfg.rope_scaling or {})},
        "rope_theta": float(cfg.rope_theta),
        **({"rope_scaling": {"rope_type": rope_type, **cfg.rope_scaling}} if cfg.rope_scaling else {}),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
        "use_cache": True,
    }


def export_hf_llama(
    model: nn.Module,
    out_dir: str | Path,
    cfg: LlamaConfig,
    *,
    pp_group=None,
    dtype: torch.dtype | None = None,
    files: Mapping[str, bytes] | None = None,
) -> Path | None:
    """Write mmm's Llama ``model`` as a Hugging Face Llama checkpoint in ``out_dir``: ``config.json``
    (:func:`hf_llama_config`) and ``model.safetensors`` (HF names; query/key rows permuted back from
    adjacent pairs to rotate-half). Every rank must call it; under pipeline parallel pass the
    pipeline's ``pp_group`` (see :func:`mmm.parallel.hf_checkpoint.export_safetensors`). Returns
    ``out_dir`` on rank 0, None elsewhere."""
    # mmm's Llama keeps the output layer apart from the embedding; tied by hand, named_parameters()
    # lists the shared tensor once (as the embedding) and the checkpoint says tie_word_embeddings
    embed, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    sources = hf_llama_sources(cfg)
    if tied:
        del sources["output.weight"]
    param_dtype = dtype or next(model.parameters()).dtype
    return export_safetensors(
        model,
        out_dir,
        sources=sources,
        config=hf_llama_config(cfg, tied=tied, dtype=param_dtype),
        pp_group=pp_group,
        dtype=dtype,
        files=files,
    )
