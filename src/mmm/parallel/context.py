"""Context parallelism: causal attention over a sequence split across the cp group, by ring attention
or by all-to-all (Ulysses), on load-balanced sequence shards.

The sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r, so every rank
has the same causal work. Attention keeps its local queries and passes keys and values around
the ring (one rotation per step, K and V stacked into one contiguous tensor); each block of
scores is computed exactly and the partial results are merged with their log-sum-exp (online
softmax). Communication is a custom autograd function whose backward sends the gradient back
the other way, so autograd gives the exact backward. Runs on gloo (CPU) and NCCL alike.

All-to-all (Ulysses, ``kind="ulysses"``) trades the ring for two all-to-alls per attention: one
turns (all heads, this rank's tokens) into (heads / cp, every token), attention runs over the whole
sequence (the load-balanced chunk order undone first, so the causal mask is the plain one), and one
turns it back. It needs the query heads (per TP rank) divisible by cp; key/value heads that are not
are repeated to the query heads before the exchange (grouped-query attention then moves cp x more
K/V bytes, still exact). Its bytes per rank do not grow with cp; the ring's do.

For your own model: give its attention module an ``attn_fn(q, k, v)`` attribute (causal SDPA by
default) and let :func:`context_parallel` set it (every such module) to ring or all-to-all attention;
shard inputs with :func:`shard_sequence` and give rotary/positional embeddings the positions from
:func:`local_positions`, which is how positions reach a model whose sequence is split: the hook sees
q and k already rotated or embedded at their global positions (mmm's Llama:
``mmm.models.llama.apply_cp_llama``).
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmm.errors import API, Spelling, UsageError


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Global token positions this cp rank holds: chunk ``cp_rank`` then chunk ``2*cp-1-cp_rank``
    (``seq_len`` must divide into ``2*cp`` chunks: no token is left out)."""
    if seq_len % (2 * cp):
        raise UsageError(
            f"a sequence of {seq_len} tokens does not divide into 2 x cp = {2 * cp} load-balanced chunks: the last "
            f"{seq_len % (2 * cp)} would be on no rank; use a sequence length divisible by {2 * cp}"
        )
    if not 0 <= cp_rank < cp:
        raise UsageError(f"cp_rank={cp_rank} is not a rank of cp={cp}; give 0 to {cp - 1}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced share of ``t`` along the sequence dimension ``dim``."""
    return t.index_select(dim, local_positions(t.shape[dim], cp_rank, cp).to(t.device))


CP_KINDS = ("ring", "ulysses")


def cp_problems(
    *, cp: int, seq_len: int, tp: int = 1, kind: str = "ring", n_heads: int | None = None, spell: Spelling = API
) -> list[str]:
    """What context parallel (and TP's sequence parallel inside it) requires of the sequence length,
    and all-to-all CP of the query heads (``n_heads``, the model's, split over tp first)."""
    if kind not in CP_KINDS:
        return [
            f"unknown context-parallel attention {spell('cp_attention', kind)}; choose one of {', '.join(CP_KINDS)}"
        ]
    if cp <= 1:
        return []
    out = []
    need = 2 * cp * tp
    if seq_len % need:
        out.append(
            f"{spell('seq_len', seq_len)} is not divisible by 2 x cp{' x tp' if tp > 1 else ''} = {need}; context "
            f"parallel cuts the sequence into 2*cp load-balanced chunks{' split again by TP' if tp > 1 else ''}; "
            f"use {spell('seq_len', seq_len - seq_len % need) + ' or ' if seq_len > need else ''}"
            f"{spell('seq_len', seq_len - seq_len % need + need)}"
        )
    if kind == "ulysses" and n_heads is not None and (n_heads % tp or (n_heads // tp) % cp):
        per = f"{n_heads} / tp={tp} = {n_heads / tp:g}" if tp > 1 else str(n_heads)
        out.append(
            f"{spell('cp_attention', kind)} splits the query heads over cp={cp}: {spell.name('n_heads')} {per} "
            f"per TP rank is not divisible by {cp}; use a cp that divides it, or {spell('cp_attention', 'ring')}"
        )
    return out


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


class SequenceSum:
    """``sequence_sum(t)``: sums ``t`` in place over the ranks that hold parts of the same sequences
    (the cp group) and returns how many they are. Shared by model copies (pipeline stages)."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, t: torch.Tensor) -> int:
        dist.all_reduce(t, group=self.group)
        return dist.get_world_size(self.group)

    def __deepcopy__(self, memo) -> SequenceSum:
        return self


_TRAFFIC = threading.local()


def traffic_axis() -> str | None:
    """The mesh axis the all-to-all being sent now belongs to, where its sender said (``axis=`` of
    :func:`all_to_all`): the experts' token exchange is ep's even where ep's ranks are those of another
    axis and torch gives both one process group (:class:`mmm.measure.CommCounter` counts it as ep's)."""
    return getattr(_TRAFFIC, "axis", None)


@contextlib.contextmanager
def _traffic_of(axis: str | None):
    before = traffic_axis()
    _TRAFFIC.axis = axis
    try:
        yield
    finally:
        _TRAFFIC.axis = before


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 (rows ``in_splits`` out, ``out_splits`` in); backward sends
    the gradient back the same way, splits swapped. Even splits when none are given."""

    @staticmethod
    def forward(ctx, t, group, in_splits, out_splits, axis):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.axis = group, in_splits, out_splits, axis
        return all_to_all(t, group, in_splits, out_splits, axis=axis)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.out_splits, ctx.in_splits, axis=ctx.axis), None, None, None, None


def all_to_all(
    t: torch.Tensor,
    group,
    in_splits: list[int] | None = None,
    out_splits: list[int] | None = None,
    *,
    axis: str | None = None,
):
    """One ``all_to_all_single`` of ``t``'s rows (no autograd: :func:`all_to_all_autograd` has it); ``axis``:
    the mesh axis whose traffic it is (:func:`traffic_axis`), where the group may be another's too."""
    t = t.contiguous()
    rows = t.shape[0] if out_splits is None else sum(out_splits)
    out = t.new_empty((rows, *t.shape[1:]))
    with _traffic_of(axis):
        dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
    return out


def all_to_all_autograd(t: torch.Tensor, group, in_splits=None, out_splits=None, *, axis=None) -> torch.Tensor:
    """:func:`all_to_all` whose backward returns each gradient row to the rank it came from."""
    return _AllToAll.apply(t, group, in_splits, out_splits, axis)


def _heads_to_sequence(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(batch, heads, local_seq, d) on each rank -> (batch, heads / cp, cp x local_seq, d): rank j gets
    heads block j of every rank's tokens, source rank by source rank."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # (dest, b, h/cp, s, d)
    got = all_to_all_autograd(send, group)  # (source, b, h/cp, s, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    b, hc, n, d = x.shape
    send = x.reshape(b, hc, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # (dest, b, h/cp, s, d)
    got = all_to_all_autograd(send, group)  # (source = heads block, b, h/cp, s, d)
    return got.transpose(0, 1).reshape(b, cp * hc, n // cp, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group) -> torch.Tensor:
    """Causal attention of load-balanced local shards (batch, heads, local_seq, head_dim) over ``group`` by
    all-to-all: each rank attends over the whole sequence with heads / cp of the heads. K/V heads not
    divisible by cp are repeated to the query heads first (exact; cp x more K/V bytes)."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp:
        raise UsageError(
            f"all-to-all context parallel splits the {q.shape[1]} query heads (per TP rank) over cp={cp}; "
            "use a cp that divides them, or ring attention"
        )
    if k.shape[1] % cp:
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    n = q.shape[2] * cp
    gathered = torch.cat([local_positions(n, r, cp) for r in range(cp)]).to(q.device)  # each row's position
    natural = torch.argsort(gathered)
    qs, ks, vs = (_heads_to_sequence(t, group, cp).index_select(2, natural) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=ks.shape[1] != qs.shape[1])
    return _sequence_to_heads(out.index_select(2, gathered), group, cp)


class UlyssesAttention(RingAttention):
    """``attn_fn(q, k, v)`` running :func:`ulysses_attention` over ``group`` (shared by model copies)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, group=self.group)


def context_parallel(
    model: torch.nn.Module, cp_mesh, *, attn_attr: str = "attn_fn", kind: str = "ring", seq_len: int | None = None
) -> list[str]:
    """Swap context-parallel attention over ``cp_mesh`` (``kind``: ring, or ulysses: all-to-all) into
    every submodule of ``model`` that has an ``attn_attr`` attribute: the attention hook, an
    SDPA-shaped causal ``attn(q, k, v)`` on (batch, heads, local_seq, head_dim) tensors, with k/v
    before or after GQA expansion alike. Modules with a ``sequence_sum`` attribute (statistics over
    whole sequences, e.g. a router's sequence-wise balance loss) get a :class:`SequenceSum` over the cp
    group. Returns the names
    of the attention modules changed (none is an error).

    Positions: the hook carries none, so the model must encode its tokens' global positions itself.
    With ``seq_len`` (the full sequence), every module with a ``shard_positions(positions)`` method is
    told this rank's (:func:`local_positions`; mmm's Llama re-indexes its rotary table), and a model
    with none is refused; a model with such a method and no ``seq_len`` is refused too (its positions
    would silently stay the first tokens'). Without either, the model takes its positions from its
    caller (``local_positions``). Shard inputs and labels with :func:`shard_sequence`."""
    if kind not in CP_KINDS:
        raise UsageError(f"unknown context-parallel attention kind={kind!r}; choose one of {', '.join(CP_KINDS)}")
    names = [name for name, mod in model.named_modules() if hasattr(mod, attn_attr)]
    if not names and type(model).__module__.startswith("transformers."):
        raise UsageError(
            f"no context parallel for {type(model).__name__}: a transformers model's attention is its own, with no "
            f"{attn_attr}(q, k, v) hook to take context parallel's (mmm's Llama has one: mmm.models.llama)"
        )
    if not names:
        raise UsageError(
            f"no module of {type(model).__name__} has an {attn_attr!r} attribute; give its attention "
            f"an {attn_attr}(q, k, v) hook (causal SDPA by default) for context parallel"
        )
    takers = [m for m in model.modules() if callable(getattr(m, "shard_positions", None))]
    if seq_len is None and takers:  # its positions would stay the first tokens': a wrong model, no error
        raise UsageError(
            f"{type(model).__name__} has a shard_positions(positions) method: give context_parallel(..., "
            "seq_len=<the full sequence length>) so that it encodes this rank's tokens' positions"
        )
    if seq_len is not None and not takers:
        raise UsageError(
            f"{type(model).__name__} has no shard_positions(positions) method: under context parallel each "
            "rank holds the tokens at mmm.parallel.context.local_positions(), and the model must encode those "
            "positions (give the module that adds positional information that method)"
        )
    if not callable(getattr(cp_mesh, "get_group", None)):
        raise UsageError(
            f"cp_mesh is a {type(cp_mesh).__name__}, not a 1-D DeviceMesh; give the cp axis (e.g. mesh['cp'] of "
            "init_mesh(cp=...))"
        )
    if seq_len is not None:
        problems = cp_problems(cp=cp_mesh.size(), seq_len=seq_len, kind=kind)
        if problems:
            raise UsageError("; ".join(problems))
    group = cp_mesh.get_group()
    attn = ring_attention_fn(group) if kind == "ring" else UlyssesAttention(group)
    for mod in model.modules():  # per-sequence statistics (a router's) sum over the ranks of the sequence
        if hasattr(mod, "sequence_sum"):
            mod.sequence_sum = SequenceSum(group)
    if seq_len is not None:
        positions = local_positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size())
        for mod in takers:
            mod.shard_positions(positions)
    for name in names:
        setattr(model.get_submodule(name), attn_attr, attn)
    return names
