"""Context parallelism: causal ring attention over the cp group, with load-balanced sequence shards.

The sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r, so every rank
has the same causal work. Attention keeps its local queries and passes keys and values around
the ring (one rotation per step, K and V stacked into one contiguous tensor); each block of
scores is computed exactly and the partial results are merged with their log-sum-exp (online
softmax). Communication is a custom autograd function whose backward sends the gradient back
the other way, so autograd gives the exact backward. Runs on gloo (CPU) and NCCL alike.

For your own model: give its attention module an ``attn_fn(q, k, v)`` attribute (causal SDPA by
default) and set it to :func:`ring_attention_fn` (:func:`context_parallel` does it for every such
module); shard inputs with :func:`shard_sequence` and give rotary/positional embeddings the positions
from :func:`local_positions` (mmm's Llama: ``mmm.models.llama.apply_cp_llama``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mmm.errors import API, Spelling, UsageError


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global token positions this cp rank holds: chunk ``cp_rank`` then chunk ``2*cp-1-cp_rank``."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced share of ``t`` along the sequence dimension ``dim``."""
    return t.index_select(dim, local_positions(t.shape[dim], cp_rank, cp).to(t.device))


def cp_problems(*, cp: int, seq_len: int, tp: int = 1, spell: Spelling = API) -> list[str]:
    """What context parallel (and TP's sequence parallel inside it) requires of the sequence length."""
    if cp <= 1:
        return []
    need = 2 * cp * tp
    if seq_len % need:
        return [
            f"{spell('seq_len', seq_len)} is not divisible by 2 x cp{' x tp' if tp > 1 else ''} = {need}; context "
            f"parallel cuts the sequence into 2*cp load-balanced chunks{' split again by TP' if tp > 1 else ''}"
        ]
    return []


class _RingShift(torch.autograd.Function):
    """Send ``t`` to the next rank of the ring, receive the previous rank's; backward: the reverse."""

    @staticmethod
    def forward(ctx, t, group, nxt, prv):
        ctx.group, ctx.nxt, ctx.prv = group, nxt, prv
        return _exchange(t.contiguous(), group, send_to=nxt, recv_from=prv)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, send_to=ctx.prv, recv_from=ctx.nxt), None, None, None


def _exchange(t: torch.Tensor, group, *, send_to: int, recv_from: int) -> torch.Tensor:
    out = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, send_to, group), dist.P2POp(dist.irecv, out, recv_from, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


def _block(q, k, v, scale, causal):
    """Exact attention of one (query chunk, key chunk) pair: output and log-sum-exp, in fp32. Keys and
    values with fewer heads than the queries (grouped-query attention) are expanded here, after the
    ring moved them: the ring carries n_kv_heads, not n_heads."""
    if k.shape[1] != q.shape[1]:
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(s - lse), v.float()), lse


def _merge(acc, new):
    if acc is None:
        return new
    (o1, l1), (o2, l2) = acc, new
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse), lse


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group) -> torch.Tensor:
    """Causal attention of load-balanced local shards (batch, heads, local_seq, head_dim) over ``group``;
    k and v may have fewer heads than q (GQA): they travel the ring unexpanded."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    scale = 1.0 / math.sqrt(q.shape[-1])
    c = q.shape[2] // 2
    q_chunks = (q[:, :, :c], q[:, :, c:])
    q_ids = (rank, 2 * cp - 1 - rank)
    acc: list = [None, None]
    kv = torch.stack([k, v])  # one contiguous tensor per rotation
    for step in range(cp):
        src = (rank - step) % cp
        k_ids = (src, 2 * cp - 1 - src)
        for qi in range(2):
            for ki in range(2):
                if k_ids[ki] > q_ids[qi]:
                    continue  # entirely in the future of these queries
                kk, vv = kv[0][:, :, ki * c : (ki + 1) * c], kv[1][:, :, ki * c : (ki + 1) * c]
                acc[qi] = _merge(acc[qi], _block(q_chunks[qi], kk, vv, scale, causal=k_ids[ki] == q_ids[qi]))
        if step < cp - 1:
            kv = _RingShift.apply(kv, group, nxt, prv)
    out = torch.cat([acc[0][0], acc[1][0]], dim=2).to(q.dtype)
    # every rotated block must stay in the autograd graph, or a peer waits forever in backward
    return out + 0.0 * kv.sum().to(out.dtype)


class RingAttention:
    """``attn_fn(q, k, v)`` running :func:`ring_attention` over ``group``. Copies of a model
    (pipeline stages are cut from deep copies) share it: a process group cannot be copied."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, group=self.group)

    def __deepcopy__(self, memo) -> RingAttention:
        return self


def ring_attention_fn(group) -> RingAttention:
    """An ``attn_fn(q, k, v)`` hook (an attention module's, e.g. mmm's Llama's) that runs ring attention."""
    return RingAttention(group)


def context_parallel(model: torch.nn.Module, cp_mesh, *, attn_attr: str = "attn_fn") -> list[str]:
    """Swap ring attention over ``cp_mesh`` into every submodule of ``model`` that has an
    ``attn_attr`` attribute: the attention hook, an SDPA-shaped causal ``attn(q, k, v)`` on
    (batch, heads, local_seq, head_dim) tensors, with k/v before or after GQA expansion alike.
    Returns the names of the modules changed (none is an error). The model must also give its
    positional encoding this rank's positions (:func:`local_positions`), and its inputs and labels
    are sharded with :func:`shard_sequence`."""
    names = [name for name, mod in model.named_modules() if hasattr(mod, attn_attr)]
    if not names:
        raise UsageError(
            f"no module of {type(model).__name__} has an {attn_attr!r} attribute; give its attention "
            f"an {attn_attr}(q, k, v) hook (causal SDPA by default) for context parallel"
        )
    attn = ring_attention_fn(cp_mesh.get_group())
    for name in names:
        setattr(model.get_submodule(name), attn_attr, attn)
    return names
