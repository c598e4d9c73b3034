"""A user's own tiny language model and its TP plan, for `python -m mmm.verify --model own_lm:build`."""

import torch
from torch import nn

TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
UP_ONLY_PLAN = {"blocks.*.up": "colwise"}  # its rowwise partner forgotten: down gets half of its input


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=128, dim=32, depth=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build():
    return TinyLM()


class TupleLM(TinyLM):
    """Returns (logits, None), as some training code's models do."""

    def forward(self, tokens):
        return super().forward(tokens), None


def build_tuple():
    return TupleLM()


class TinySequentialLM(TinyLM):
    """The same model with its blocks in an ``nn.Sequential`` (called as one module)."""

    def __init__(self, vocab=128, dim=32, depth=4):
        super().__init__(vocab, dim, depth)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(depth)])

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def build_sequential():
    return TinySequentialLM()


# a mixture of experts taken from mmm's models, its experts plan given as data (--ep-plan own_lm:EP_PLAN)
EP_PLAN = {"layers.*.moe.experts": "experts"}


def build_moe():
    from mmm.models.llama import Llama, LlamaConfig

    return Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=128, seq_len=32, moe_experts=4, moe_top_k=2))


class PlainExperts(nn.Module):
    """Experts (E, ...) run one by one; with no tokens it returns a plain empty tensor, cut off from backward
    (what a user writes first: under ep that rank would skip the all-to-all its peers wait in)."""

    def __init__(self, n, dim, hidden):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n, hidden, dim))
        self.w_out = nn.Parameter(torch.empty(n, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.w_in, std=0.05)
        nn.init.normal_(self.w_out, std=0.05)

    def forward(self, x, counts):
        w_in, w_out = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w_in, self.w_out))
        outs = [torch.relu(t @ w_in[e].T) @ w_out[e].T for e, t in enumerate(x.split(counts)) if len(t)]
        return torch.cat(outs) if outs else x.new_zeros((0, x.shape[1]))


class FirstExpertMoE(nn.Module):  # every token to expert 0: under ep 2, rank 1's experts get none
    def __init__(self, dim, n=4):
        super().__init__()
        self.experts, self.n = PlainExperts(n, dim, 2 * dim), n

    def run_experts(self, experts, x, counts):
        return experts(x, counts)

    def forward(self, x):
        t = x.reshape(-1, x.shape[-1])
        return x + self.run_experts(self.experts, t, [t.shape[0]] + [0] * (self.n - 1)).view_as(x)


class PlainMoELM(TinyLM):
    def __init__(self, vocab=128, dim=32, depth=2):
        super().__init__(vocab, dim, depth)
        self.blocks = nn.ModuleList([FirstExpertMoE(dim) for _ in range(depth)])


def build_plain_moe():
    return PlainMoELM()


PLAIN_EP_PLAN = {"blocks.*.experts": "experts"}


class HeadFirstLM(TinyLM):  # the head registered before the blocks: a pipeline splits in registration order
    def __init__(self, vocab=128, dim=32, depth=4):
        nn.Module.__init__(self)
        self.head = nn.Linear(dim, vocab)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])


def build_headfirst():
    return HeadFirstLM()


class PositionsLM(TinyLM):  # GPT-2's tok(x) + pos(p): two modules before the blocks, combined in the forward
    def __init__(self, vocab=128, dim=32, depth=4, seq=64):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_positions():
    return PositionsLM()


class PositionsLastLM(PositionsLM):  # the same forward, its position table registered after the blocks
    def __init__(self, vocab=128, dim=32, depth=4, seq=64):
        TinyLM.__init__(self, vocab, dim, depth)
        self.pos = nn.Embedding(seq, dim)


def build_positions_last():
    return PositionsLastLM()


class PositionsOffMetaLM(PositionsLM):  # the same, whole only off meta (as a model with collectives in its forward)
    def forward(self, tokens):
        if tokens.is_meta and len(self.blocks) == 4:  # the whole model; a pipeline stage holds fewer blocks
            raise RuntimeError("this model does not run on meta")
        return super().forward(tokens)


def build_positions_off_meta():
    return PositionsOffMetaLM()


class Embed(nn.Module):  # tokens and positions in one module: what a pipeline needs before its blocks
    def __init__(self, vocab, dim, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)

    def forward(self, tokens, positions):
        return self.tok(tokens) + self.pos(positions)


class EmbedLM(TinyLM):
    def __init__(self, vocab=128, dim=32, depth=4, seq=64):
        nn.Module.__init__(self)
        self.embed = Embed(vocab, dim, seq)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens, torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_embed():
    return EmbedLM()


class Widen(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class WideningLM(TinyLM):  # blocks that change the width (a pyramid): each stage hands on another shape
    def __init__(self, vocab=128, dims=(32, 40, 48, 56, 64)):
        nn.Module.__init__(self)
        self.embed = nn.Embedding(vocab, dims[0])
        self.blocks = nn.ModuleList([Widen(a, b) for a, b in zip(dims, dims[1:])])
        self.head = nn.Linear(dims[-1], vocab)


def build_widening():
    return WideningLM()
