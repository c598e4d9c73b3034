"""Load a Hugging Face safetensors checkpoint into a sharded model, each rank reading only its part.

    from mmm.parallel.hf_checkpoint import llama_config_from_hf, load_hf_llama
    cfg = llama_config_from_hf("path/to/llama")              # config.json -> mmm's LlamaConfig
    with meta_init():
        model = Llama(cfg)
    model = parallelize(model, mesh, spec, device=dev, seed=0)
    load_hf_llama(model, "path/to/llama")                    # model.safetensors (or its index + shards)

Every parameter, plain or a DTensor shard (FSDP, TP, both), is filled from a safetensors slice
covering this rank's region of the global tensor: a rank reads its rows/columns, never the whole
checkpoint. Names are mapped from Hugging Face's Llama layout to mmm's (``model.layers.0.self_attn.
q_proj.weight`` -> ``layers.0.attention.wq.weight``), and the query/key projections are permuted from
HF's rotary layout (rotate-half: the two halves of a head are the pairs) to mmm's (adjacent pairs).
:func:`load_safetensors` is the generic loader (a Hugging Face model loads with its own names).

The way out, :func:`export_hf_llama`, is the inverse: every rank takes part (DTensor shards are
gathered with ``full_tensor()``; under pipeline parallel, the ranks of rank 0's pipeline send their
stages to it), and rank 0 writes ``config.json`` + ``model.safetensors`` that transformers'
``LlamaForCausalLM.from_pretrained`` loads, and that ``load_hf_llama`` reads back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from mmm.errors import UsageError

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
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class Source:
    """Where a parameter comes from: a tensor name in the checkpoint, and for rotary projections the
    head size whose halves are re-interleaved (HF rotate-half -> adjacent pairs)."""

    def __init__(self, key: str, rotary_head_dim: int | None = None) -> None:
        self.key, self.rotary_head_dim = key, rotary_head_dim


def _files(path: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it (one file, or an index of shards)."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {k: path / v for k, v in weight_map.items()}
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UsageError(
            f"no safetensors checkpoint in {path} (expected model.safetensors or "
            "model.safetensors.index.json); save one with transformers' save_pretrained()"
        )
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: f for k in handle.keys()})
    return out


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the global tensor this rank holds (all of it for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _unrotate(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF's rotary layout (per head: first half, second half) -> adjacent pairs, on whole heads."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _rotate(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """mmm's rotary layout (adjacent pairs) -> HF's (per head: first half, second half): the inverse of
    :func:`_unrotate`."""
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _read(handle, source: Source, region: tuple[slice, ...]) -> torch.Tensor:
    part = handle.get_slice(source.key)
    if source.rotary_head_dim is None:
        return part[region] if region else part[:]
    hd = source.rotary_head_dim  # read the whole heads that cover the rows, permute, cut
    rows, rest = region[0], region[1:]
    first, last = rows.start // hd * hd, -(-rows.stop // hd) * hd
    block = _unrotate(part[(slice(first, last), *rest)], hd)
    return block[rows.start - first : rows.stop - first]


@torch.no_grad()
def load_safetensors(
    model: nn.Module,
    path: str | Path,
    *,
    sources: Mapping[str, Source] | None = None,
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """Fill every parameter of ``model`` (materialised: plain, or DTensor shards) from the safetensors
    checkpoint at ``path``: ``sources[name]`` (or the parameter's own name) says which tensor.
    Shapes are checked; a parameter the checkpoint lacks is an error. Returns the checkpoint's
    tensors nothing took (e.g. ``lm_head.weight`` of a tied model)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from mmm.parallel.meta import canonical_name

    path = Path(path)
    where = _files(path)
    plan: dict[Path, list[tuple[torch.Tensor, Source, str]]] = {}
    missing = []
    for name, param in model.named_parameters():
        name = canonical_name(name)
        src = (sources or {}).get(name) or Source(rename(name) if rename else name)
        if src.key not in where:
            missing.append(f"{name} (looked for {src.key})")
            continue
        plan.setdefault(where[src.key], []).append((param, src, name))
    if missing:
        raise UsageError(
            f"{path} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}"
        )
    for file, items in plan.items():
        with safe_open(str(file), framework="pt") as handle:
            for param, src, name in items:
                shape = tuple(handle.get_slice(src.key).get_shape())
                if shape != tuple(param.shape):
                    raise UsageError(
                        f"{file.name}: {src.key} has shape {list(shape)} but {name} is "
                        f"{list(param.shape)}; the checkpoint is for another configuration"
                    )
                local = param.to_local() if isinstance(param, DTensor) else param
                local.copy_(_read(handle, src, local_region(param)).to(local.dtype))
    taken = {src.key for items in plan.values() for _, src, _ in items}
    return sorted(set(where) - taken)


# --------------------------------------------------------------------------- Llama
def _hf_config(path: Path) -> dict:
    if not path.exists():
        raise UsageError(
            f"{path} does not exist; give a Hugging Face checkpoint directory (config.json + "
            "*.safetensors, as save_pretrained() writes it)"
        )
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.exists():
        raise UsageError(f"no config.json in {file.parent}: a Hugging Face checkpoint directory has one")
    return json.loads(file.read_text())


def llama_config_from_hf(path: str | Path, *, seq_len: int | None = None):
    """mmm's :class:`~mmm.models.llama.LlamaConfig` for the Hugging Face Llama in ``path``
    (its config.json); ``seq_len`` (default: max_position_embeddings) sizes the rotary table."""
    from mmm.models.llama import LlamaConfig

    hf = _hf_config(Path(path))
    if hf.get("model_type") != "llama":
        raise UsageError(
            f"{path} holds a {hf.get('model_type')!r} model; this loader reads Llama checkpoints (model_type 'llama')"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if rope_type != "default":
        problems.append(f"rope_type {rope_type!r} (mmm's Llama has plain rotary embeddings)")
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
    )


def hf_llama_sources(cfg, *, tied: bool = False) -> dict[str, Source]:
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
    hf = _hf_config(path)
    cfg = getattr(model, "cfg", None) or llama_config_from_hf(path)
    tied = bool(hf.get("tie_word_embeddings")) and "lm_head.weight" not in _files(path)
    load_safetensors(model, path, sources=hf_llama_sources(cfg, tied=tied))


# --------------------------------------------------------------------------- Llama out
def hf_llama_config(cfg, *, tied: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """transformers' ``LlamaConfig`` (as config.json) of mmm's :class:`~mmm.models.llama.LlamaConfig`:
    the inverse of :func:`llama_config_from_hf` (``max_position_embeddings`` is ``seq_len``)."""
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
        # rope_parameters for transformers >= 5, rope_theta for the releases before
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        "rope_theta": float(cfg.rope_theta),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
        "use_cache": True,
    }


@torch.no_grad()
def export_hf_llama(
    model: nn.Module, out_dir: str | Path, cfg, *, pp_group=None, dtype: torch.dtype | None = None
) -> Path | None:
    """Write mmm's Llama ``model`` as a Hugging Face Llama checkpoint in ``out_dir``: ``config.json``
    (:func:`hf_llama_config`) and ``model.safetensors`` (HF names; query/key rows permuted back from
    adjacent pairs to rotate-half). Works on any mesh: every rank must call it, since DTensor shards
    (FSDP, TP, both) are gathered one parameter at a time with ``full_tensor()``; under pipeline
    parallel, pass the pipeline's ``pp_group``: the ranks of rank 0's pipeline send their stages'
    parameters to rank 0, one tensor at a time. Only rank 0 holds the whole model (on the host) and
    writes; ``dtype`` casts on the way (default: the parameters' own). Returns ``out_dir`` on rank 0,
    None elsewhere."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mmm.parallel.meta import canonical_name

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{str(out)!r} is a file; export to a directory (it is created if missing)")
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:  # every rank checks, before any collective
        raise UsageError("exporting a Hugging Face checkpoint needs safetensors: pip install 'mmm[hf]'")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    sources = hf_llama_sources(cfg)
    members = dist.get_process_group_ranks(pp_group) if pp_group is not None else [rank]
    collects = 0 in members  # this rank belongs to rank 0's pipeline (or is rank 0)
    tensors: dict[str, torch.Tensor] = {}
    params = [(canonical_name(n), p) for n, p in model.named_parameters()]
    unknown = [n for n, _ in params if n not in sources]
    if unknown:
        raise UsageError(
            f"export_hf_llama writes mmm's Llama; {type(model).__name__} has other parameters: {', '.join(unknown[:4])}"
        )
    if collects and rank != 0:  # a later stage of rank 0's pipeline: say what will come, then send it
        dist.send_object_list([[(sources[n].key, tuple(p.shape), p.dtype) for n, p in params]], dst=0, group=pp_group)
    for name, param in params:
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if not collects:
            continue  # gathered only because the collective needs every rank of the mesh
        hd = sources[name].rotary_head_dim
        full = _rotate(full, hd) if hd else full
        if rank == 0:
            tensors[sources[name].key] = full.to("cpu", dtype or full.dtype).contiguous()
        else:
            dist.send(full.contiguous(), dst=0, group=pp_group)
        del full
    if rank == 0:
        for peer in members:
            if peer == 0:
                continue
            listing: list = [None]
            dist.recv_object_list(listing, src=peer, group=pp_group)
            device = next(iter(model.parameters())).device
            for key, shape, param_dtype in listing[0]:
                buf = torch.empty(shape, dtype=param_dtype, device=device)
                dist.recv(buf, src=peer, group=pp_group)
                tensors[key] = buf.to("cpu", dtype or param_dtype).contiguous()
        # mmm's Llama keeps the output layer apart from the embedding; tied by hand, named_parameters()
        # lists the shared tensor once (as the embedding) and the checkpoint says tie_word_embeddings
        embed, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
        tied = embed is not None and head is not None and head.weight is embed.weight
        _write_hf_llama(out, tensors, cfg, dtype=dtype or next(iter(tensors.values())).dtype, tied=tied)
    if distributed:
        dist.barrier()  # the checkpoint is complete when any rank returns
    return out if rank == 0 else None


def _write_hf_llama(out: Path, tensors: dict[str, torch.Tensor], cfg, *, dtype: torch.dtype, tied: bool) -> None:
    from safetensors.torch import save_file

    expected = {s.key for k, s in hf_llama_sources(cfg).items() if not (tied and k == "output.weight")}
    missing = sorted(expected - set(tensors))
    if missing:
        raise UsageError(
            f"cannot export: no rank sent {', '.join(missing[:4])}; under pipeline parallel pass "
            "pp_group= so that the other stages reach rank 0"
        )
    out.mkdir(parents=True, exist_ok=True)
    index = out / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint there would be read instead of the file written now
        for shard in set(json.loads(index.read_text()).get("weight_map", {}).values()):
            (out / shard).unlink(missing_ok=True)
        index.unlink()
    tmp = out / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(hf_llama_config(cfg, tied=tied, dtype=dtype), indent=2) + "\n")
    os.replace(tmp, out / "config.json")
