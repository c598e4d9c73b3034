"""Mixture of experts for the Llama blocks: a top-k router and SwiGLU experts, plain single-device code.

Routing (token choice, nothing dropped): every token goes to the ``top_k`` experts of highest
``softmax(router logits) + expert_bias``; its output is the experts' outputs weighted by their softmax
scores, renormalised over the k chosen. The router runs in fp32, its weights too under bf16
(``keep_fp32``: FSDP makes it a unit of its own, and autocast is off inside it).

Load balance (DeepSeek-V3's two mechanisms):

- **auxiliary-loss-free bias**: ``expert_bias`` only decides which experts are chosen; after each
  optimizer step it moves by ``bias_rate`` towards balance (``+rate`` for an expert that got fewer
  tokens than the mean, ``-rate`` for more), from the step's token counts over the WHOLE global
  batch (every data- and context-parallel rank and microbatch: :func:`mmm.parallel.experts.balance_experts`),
  so every layout routes as one process does;
- **sequence-wise auxiliary loss** (``aux_weight`` alpha): for each sequence,
  ``alpha * sum_i f_i * P_i`` with ``f_i = E / (k T) * (tokens of the sequence routed to i)`` and ``P_i``
  the mean score of expert i over the sequence's T tokens; averaged over the sequences. It is linear
  in the sequences, so data parallel and microbatches give one process's loss as they do for the
  cross-entropy; a sequence split by context parallel sums its counts over the cp ranks first
  (``sequence_sum``). Its gradient joins through the activations (:class:`AuxLoss`), so a pipeline
  stage in the middle trains it too; its value is recorded (``aux_sum``), not added to the loss shown.

Hooks for parallelism, set from outside (:mod:`mmm.parallel.experts`): ``run_experts(experts, x, counts)``
runs the experts on tokens sorted by expert (``counts`` per expert; expert parallel swaps in the
all-to-all), ``sequence_sum`` (context parallel: sums a tensor over the ranks of each sequence),
``counting`` (off while a pipeline stage's shapes are inferred), ``planned_counts`` (the planner's
simulated step, on tensors without values: how many tokens each expert gets).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmm.models.grouped import counts_tokens, grouped_linear, grouped_mm_available, no_tokens, padded_groups


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards as 3-D weights (expert first): ``w1``/``w3`` (E, hidden, dim),
    ``w2`` (E, dim, hidden). Expert parallel shards dim 0, tensor parallel the hidden width
    (``tensor_parallel_dims``); this module runs whichever experts, and whatever width of them, it holds.

    ``grouped``: run all experts as three grouped matmuls (``F.grouped_mm``, each expert's rows padded:
    :mod:`mmm.models.grouped`) instead of a loop of three matmuls per expert; None (the default) groups
    them on CUDA 9.0+ (:func:`grouped_mm_available`), where the loop's many small kernels leave the device
    idle, and loops elsewhere. Both give the same result to rounding."""

    tensor_parallel_dims = {"w1": 1, "w2": 2, "w3": 1}  # each weight's hidden dimension

    def __init__(self, num_experts: int, dim: int, hidden: int, *, grouped: bool | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.grouped = grouped
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def runs_grouped(self, x: torch.Tensor) -> bool:
        """Whether tokens like ``x`` run as grouped matmuls (``grouped``, or by default where it pays)."""
        return self.grouped if self.grouped is not None else grouped_mm_available(x)

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """``x``: tokens sorted by (local) expert, ``counts[e]`` of them for expert e (a list, or a tensor on
        the device: the grouped path then needs nothing from the host)."""
        w1, w2, w3 = local(self.w1), local(self.w2), local(self.w3)
        if self.runs_grouped(x) and x.shape[0]:
            return _grouped_swiglu(x, counts, w1, w2, w3)
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):
            if xe.shape[0]:
                outs.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
        if not outs:
            return no_tokens(x, w2.shape[1], w1, w2, w3)
        return torch.cat(outs)


def _grouped_swiglu(
    x: torch.Tensor, counts: list[int] | torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """The experts' SwiGLU as three grouped matmuls over ``x``'s rows grouped by ``counts``
    (:func:`mmm.models.grouped.padded_groups`: counts on the device stay there)."""
    xp, rows, offs = padded_groups(x, counts)
    with torch.autocast(x.device.type, enabled=False):  # the kernel takes one dtype: the tokens'
        h = F.silu(grouped_linear(xp, w1, offs)) * grouped_linear(xp, w3, offs)
        return grouped_linear(h, w2, offs).index_select(0, rows)


def run_local(experts: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The default ``run_experts`` hook: every expert is here."""
    return experts(x, counts)


class AuxLoss(torch.autograd.Function):
    """Passes ``x`` through unchanged; in backward gives ``aux`` the gradient 1 (so ``aux`` is trained as
    if added to the loss) wherever the loss itself is computed."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.dtype, ctx.device = aux.dtype, aux.device
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.dtype, device=ctx.device)


class Router(nn.Module):
    """Top-k token-choice router in fp32 (see the module doc): ``gate`` logits, ``expert_bias`` for
    choosing, per-step counters for balancing and the record."""

    keep_fp32 = True  # under bf16 too: FSDP keeps this module's weights fp32 in compute

    def __init__(self, dim: int, num_experts: int, top_k: int, *, aux_weight: float, bias_rate: float) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_weight, self.bias_rate = aux_weight, bias_rate
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(num_experts))  # in checkpoints: routing depends on it
        # what this rank routed since the last balance step (training forwards only, not recomputations)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(2), persistent=False)  # (sum of aux values, forwards)
        self.register_buffer("min_margin", torch.full((), float("inf")), persistent=False)
        self.sequence_sum = None  # context parallel: sums over the ranks holding the rest of each sequence
        self.counting = True  # off while a pipeline infers its stages' shapes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``x`` (batch, seq, dim) -> (weights (N, k), experts (N, k), aux loss or None), N = batch x seq."""
        bsz, seq, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):  # fp32 even under an autocast (mmm's bf16 off FSDP)
            logits = F.linear(x.reshape(-1, x.shape[-1]).float(), local(self.gate.weight).float())
        scores = logits.softmax(dim=-1)
        ranked = (scores + self.expert_bias).detach()
        chosen = ranked.topk(self.top_k + (self.top_k < self.num_experts), dim=-1)
        experts = chosen.indices[:, : self.top_k]
        weights = scores.gather(-1, experts)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        counting = counts_tokens(self)
        aux = None
        if self.aux_weight > 0 and self.training:
            aux = self._sequence_aux(scores.view(bsz, seq, -1), experts.view(bsz, seq, -1), seq)
        if counting:
            with torch.no_grad():
                self.tokens_per_expert += torch.bincount(experts.flatten(), minlength=self.num_experts).float()
                if chosen.indices.shape[1] > self.top_k:  # how close the k-th and the next expert came
                    gap = (chosen.values[:, self.top_k - 1] - chosen.values[:, self.top_k]).min()
                    self.min_margin.copy_(torch.minimum(self.min_margin, gap))
                if aux is not None:
                    self.aux_sum += torch.stack([aux.detach().float(), torch.ones((), device=aux.device)])
        return weights, experts, aux

    def _sequence_aux(self, scores: torch.Tensor, experts: torch.Tensor, seq: int) -> torch.Tensor:
        """alpha * mean over sequences of sum_i f_i P_i (module doc); under context parallel the counts of
        each sequence are summed over its cp ranks, P_i is this rank's share of the mean."""
        counts = torch.zeros(scores.shape[0], self.num_experts, device=scores.device)
        counts.scatter_add_(1, experts.flatten(1), torch.ones_like(experts.flatten(1), dtype=counts.dtype))
        tokens = seq
        if self.sequence_sum is not None:
            tokens = seq * self.sequence_sum(counts)
        f = counts * (self.num_experts / (self.top_k * tokens))
        p = scores.mean(dim=1)  # this rank's tokens; the mean over cp ranks is the sequence's
        return self.aux_weight * (f * p).sum(dim=-1).mean()


class MoE(nn.Module):
    """A mixture-of-experts feed-forward: router, routed experts, and an optional ``shared`` expert (a
    dense feed-forward every token goes through)."""

    def __init__(
        self,
        dim: int,
        *,
        num_experts: int,
        top_k: int,
        hidden: int,
        shared: nn.Module | None = None,
        aux_weight: float = 0.0,
        bias_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.router = Router(dim, num_experts, top_k, aux_weight=aux_weight, bias_rate=bias_rate)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = shared
        self.run_experts = run_local  # expert parallel: all-to-all dispatch (mmm.parallel.experts)
        self.planned_counts = None  # a simulated step (no values): (token slots, experts) -> tokens per expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        weights, experts, aux = self.router(x)
        tokens = x.reshape(-1, dim)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        if self.planned_counts is not None:
            counts = self.planned_counts(flat.numel(), self.router.num_experts)
        else:
            counts = torch.bincount(flat, minlength=self.router.num_experts)
            if self.run_experts is not run_local or not self.experts.runs_grouped(tokens):
                counts = counts.tolist()  # the loop and expert parallel's all-to-all split on the host
        routed = self.run_experts(self.experts, tokens[order // experts.shape[1]], counts)
        slots = torch.empty_like(routed).index_copy_(0, order, routed)  # back to (token, slot) order
        out = (slots.view(-1, experts.shape[1], dim) * weights.unsqueeze(-1).to(slots.dtype)).sum(dim=1)
        out = out.view(bsz, seq, dim).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return AuxLoss.apply(out, aux) if aux is not None else out
