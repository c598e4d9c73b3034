"""A Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, causal SDPA.

Plain single-device code. It is laid out so that parallelism can be applied from outside:
layers live in a ``ModuleDict`` keyed "0", "1", ... (names stay stable when a pipeline
stage drops some), the top-level forward loops over them, and attention infers its local
head count from the projection width (``view(..., -1, head_dim)``) so a tensor-parallel
plan can shard heads without the model knowing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from mmm.models.llama.moe import GroupedExperts, MoE, Router


@dataclass
class LlamaConfig:
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 8
    """Query heads; dim must be divisible by it."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention (default: n_heads); must divide n_heads."""
    vocab_size: int = 256
    """Vocabulary (256 = bytes)."""
    seq_len: int = 128
    """Longest sequence the rotary table covers."""
    multiple_of: int = 32
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    ffn_hidden_dim: int | None = None
    """The SwiGLU hidden width itself (a Hugging Face config's intermediate_size); overrides the rule above."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """Llama 3.1's rotary frequency scaling (``rope_type`` "llama3" of a Hugging Face config): ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; None: plain rotary."""
    moe_experts: int = 0
    """Routed experts per block (0: a dense SwiGLU feed-forward): :mod:`mmm.models.llama.moe`."""
    moe_top_k: int = 2
    """Experts each token goes to."""
    moe_hidden: int | None = None
    """Each expert's SwiGLU width (default: the dense width / top_k: about the dense model's active FLOPs)."""
    moe_shared: int = 0
    """Shared experts (a dense SwiGLU of moe_shared x moe_hidden every token goes through)."""
    moe_aux: float = 0.0
    """Weight of the sequence-wise load-balancing loss (DeepSeek-V3 uses 1e-4); 0: none."""
    moe_bias_rate: float = 1e-3
    """Step of the auxiliary-loss-free balancing bias per optimizer step; 0: no bias."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * -(-hidden // self.multiple_of)

    @property
    def moe(self) -> bool:
        return self.moe_experts > 0

    @property
    def expert_hidden(self) -> int:
        if self.moe_hidden is not None:
            return self.moe_hidden
        return max(self.multiple_of, self.multiple_of * round(self.ffn_hidden / self.moe_top_k / self.multiple_of))

    def problems(self) -> list[str]:
        """Shape constraints that do not depend on parallelism, each naming the values."""
        out = self.moe_problems()
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if out:
            return out
        if self.dim % self.n_heads:
            out.append(f"--dim {self.dim} is not divisible by --n-heads {self.n_heads}")
        elif self.head_dim % 2:
            out.append(f"head dim {self.head_dim} (= dim / n_heads) must be even for rotary embeddings")
        if self.n_heads % self.n_kv_heads:
            out.append(f"--n-heads {self.n_heads} is not divisible by --n-kv-heads {self.n_kv_heads}")
        return out

    def moe_problems(self) -> list[str]:
        if self.moe_experts < 0:
            return [f"--moe-experts {self.moe_experts} must be >= 0 (0: a dense model)"]
        if not self.moe:
            defaults = {f.name: f.default for f in fields(self)}
            moe = ("moe_top_k", "moe_hidden", "moe_shared", "moe_aux", "moe_bias_rate")
            given = [f"--{f.replace('_', '-')} {getattr(self, f)}" for f in moe if getattr(self, f) != defaults[f]]
            if not given:
                return []
            verb = "applies" if len(given) == 1 else "apply"
            return [f"{', '.join(given)} only {verb} to a mixture of experts; add --moe-experts N or drop them"]
        out = []
        if not 1 <= self.moe_top_k <= self.moe_experts:
            default = " (its default)" if self.moe_top_k == type(self).moe_top_k else ""
            out.append(f"--moe-top-k {self.moe_top_k}{default} must be between 1 and --moe-experts {self.moe_experts}")
        if self.moe_hidden is not None and self.moe_hidden < 1:
            out.append(f"--moe-hidden {self.moe_hidden} must be >= 1")
        if self.moe_shared < 0:
            out.append(f"--moe-shared {self.moe_shared} must be >= 0")
        for name in ("moe_aux", "moe_bias_rate"):
            value = getattr(self, name)
            if not (value >= 0 and value < float("inf")):
                out.append(f"--{name.replace('_', '-')} {value} must be a finite number >= 0")
        return out

    def num_params(self, *, embedding: bool = True, active: bool = False) -> int:
        """Parameters (``active``: those one token uses: top_k of the routed experts)."""
        d, h, kv = self.dim, self.head_dim, self.n_kv_heads
        attn = d * self.n_heads * h + 2 * d * kv * h + self.n_heads * h * d
        if self.moe:
            experts = self.moe_top_k if active else self.moe_experts
            ffn = 3 * d * self.expert_hidden * (experts + self.moe_shared) + d * self.moe_experts
        else:
            ffn = 3 * d * self.ffn_hidden
        block = attn + ffn + 2 * d
        total = self.n_layers * block + d + self.vocab_size * d  # final norm + output
        return total + (self.vocab_size * d if embedding else 0)


def rope_table(head_dim: int, seq_len: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """cos/sin for rotary embeddings: shape (seq_len, head_dim // 2, 2); ``scaling``: Llama 3.1's
    (:func:`llama3_frequencies`)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling:
        freqs = llama3_frequencies(freqs, **scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def llama3_frequencies(
    freqs: torch.Tensor,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1's rotary frequencies for a longer context: a wavelength shorter than
    ``original / high_freq_factor`` is kept, one longer than ``original / low_freq_factor`` is stretched
    ``factor`` times (its frequency divided), and those between move smoothly from one to the other."""
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = (1 - smooth) * freqs / factor + smooth * freqs
    long = wavelen > original_max_position_embeddings / low_freq_factor
    short = wavelen < original_max_position_embeddings / high_freq_factor
    return torch.where(long, freqs / factor, torch.where(short, freqs, between))


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x (batch, seq, heads, head_dim) by the table rows for its positions."""
    xf = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[: x.shape[1], None, :, 0], table[: x.shape[1], None, :, 1]
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention; k/v may have fewer heads than q (grouped-query attention, expanded inside)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's kernel (fused on CUDA) computes in fp32 inside: no fp32 copies of x kept for backward
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # (q, k, v) -> output, (batch, heads, seq, head_dim) with k/v n_rep times fewer heads (GQA);
        # context parallel swaps in ring attention
        self.attn_fn = causal_sdpa

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1: the local head count, which a TP plan divides by the TP degree
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # k/v keep their n_kv_heads: attn_fn expands them (context parallel sends them unexpanded)
        out = self.attn_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.moe:  # a mixture of experts in place of the dense feed-forward
            self.moe = MoE(
                cfg.dim,
                num_experts=cfg.moe_experts,
                top_k=cfg.moe_top_k,
                hidden=cfg.expert_hidden,
                shared=FeedForward(cfg.dim, cfg.moe_shared * cfg.expert_hidden) if cfg.moe_shared else None,
                aux_weight=cfg.moe_aux,
                bias_rate=cfg.moe_bias_rate,
            )
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        problems = cfg.problems()
        if problems:  # a config built in code: refused here rather than at its first forward
            raise ValueError(f"LlamaConfig: {'; '.join(problems)}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rope = rope_table(cfg.head_dim, cfg.seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope", rope, persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Initialise every parameter (torchtitan's convention). Works on any part
        of the model: a pipeline stage has ``nn.Identity`` where its blocks, embedding or head are not.
        Under :func:`mmm.parallel.materialize` each parameter is seeded from its name, so the weights
        do not depend on the mesh."""
        depth_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        for mod in self.modules():
            if isinstance(mod, nn.Embedding):
                nn.init.normal_(mod.weight, std=1.0)
            elif isinstance(mod, RMSNorm):
                nn.init.ones_(mod.weight)
            elif isinstance(mod, Attention):
                for lin in (mod.wq, mod.wk, mod.wv):
                    nn.init.trunc_normal_(lin.weight, std=0.02)
                nn.init.trunc_normal_(mod.wo.weight, std=depth_std)
            elif isinstance(mod, FeedForward):
                nn.init.trunc_normal_(mod.w1.weight, std=0.02)
                for lin in (mod.w2, mod.w3):
                    nn.init.trunc_normal_(lin.weight, std=depth_std)
            elif isinstance(mod, GroupedExperts):
                nn.init.trunc_normal_(mod.w1, std=0.02)
                for w in (mod.w2, mod.w3):
                    nn.init.trunc_normal_(w, std=depth_std)
            elif isinstance(mod, Router):  # logits of about unit scale: routing far from ties
                nn.init.trunc_normal_(mod.gate.weight, std=self.cfg.dim**-0.5)
        if isinstance(self.output, nn.Linear):
            nn.init.trunc_normal_(self.output.weight, std=self.cfg.dim**-0.5)

    def shard_positions(self, positions: torch.Tensor) -> None:
        """This model sees the tokens at ``positions`` of each sequence (context parallel's share): the
        rotary table keeps their rows."""
        self.rope = self.rope[positions.to(self.rope.device)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h
