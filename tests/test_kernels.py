"""The step's kernels: the chunked cross-entropy (fp32 numerics, no fp32 copy of the logits kept), torch's
RMSNorm kernel in mmm's models, fused AdamW and when it is not taken. In one process; the real runs
(tests/test_experts.py, tests/test_fsdp_tp.py) check what the trainer picks on several ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmm.models.grouped import grouped_mm_available
from mmm.models.llama.model import RMSNorm
from mmm.models.llama.recipe import loss_fn
from mmm.parallel.loss import cross_entropy
from mmm.parallel.optim import adamw, fused_problem, implementation


def _pair(dtype, rows=37, vocab=50):
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (rows,))
    return logits, logits.detach().clone().requires_grad_(), targets


@pytest.mark.parametrize("chunk", [500, 2**26], ids=["8-chunks", "one-chunk"])
def test_cross_entropy_is_torchs_in_fp32(chunk):
    mine, ref, targets = _pair(torch.float32)
    targets[3] = -100  # ignored, as F.cross_entropy ignores it
    a = cross_entropy(mine, targets, chunk_elements=chunk)
    b = F.cross_entropy(ref, targets)
    (a * 0.5).backward()
    (b * 0.5).backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    assert torch.allclose(mine.grad, ref.grad, rtol=1e-5, atol=1e-8)
    assert mine.grad[3].abs().max() == 0


def test_cross_entropy_in_bf16_gives_the_float_forms_gradient():
    """bf16 logits: the loss in fp32, and the gradient ``F.cross_entropy(logits.float())`` hands back: bit
    for bit for the loss itself (both round the same fp32 values to bf16 once), within a bf16 rounding
    under a scale (microbatches: the kept bf16 gradient is scaled and rounded again)."""
    for scale in (1.0, 1 / 3):
        mine, ref, targets = _pair(torch.bfloat16, rows=64, vocab=300)
        a = cross_entropy(mine, targets, chunk_elements=3000)
        b = F.cross_entropy(ref.float(), targets)
        assert a.dtype == torch.float32 and a.item() == pytest.approx(b.item(), rel=1e-6)
        (a * scale).backward()
        (b * scale).backward()
        if scale == 1.0:
            assert torch.equal(mine.grad, ref.grad)
        else:
            assert torch.allclose(mine.grad.float(), ref.grad.float(), rtol=2**-7, atol=1e-9)


def test_cross_entropy_leaves_the_logits_alone():
    """fp32 logits (``.float()`` is the tensor itself) are not overwritten by the chunks' softmax: an op
    before the loss that saved its output still backpropagates, and the logits read after are the same."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 8), torch.randn(8, 40, requires_grad=True)
    targets = torch.randint(0, 40, (16,))
    logits = torch.tanh(x @ w)  # tanh saves its output for backward
    before = logits.detach().clone()
    cross_entropy(logits, targets, chunk_elements=200).backward()
    assert torch.equal(logits.detach(), before)
    got = w.grad.clone()
    w.grad = None
    F.cross_entropy(torch.tanh(x @ w), targets).backward()
    assert torch.allclose(got, w.grad, rtol=1e-5, atol=1e-7)


def test_cross_entropy_refuses_a_target_out_of_range_as_torch_does():
    logits = torch.randn(4, 10)
    for bad in (-1, 10):
        with pytest.raises((IndexError, RuntimeError)):
            cross_entropy(logits, torch.tensor([1, bad, 2, 3]))


def _saved_bytes(fn, logits, targets) -> int:
    saved = {}  # by storage: a tensor saved twice is kept once

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, targets)
    return sum(saved.values())


def test_the_trainers_loss_keeps_no_fp32_copy_of_the_logits():
    """What backward keeps of bf16 logits: their gradient in bf16 (2 bytes a logit), where
    ``F.cross_entropy(logits.float())`` keeps an fp32 log-softmax (4 bytes a logit). The logits themselves
    are not kept (the loss's input is not saved)."""
    logits = torch.randn(4, 16, 512, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 512, (4, 16))
    size = logits.numel() * logits.element_size()
    assert _saved_bytes(loss_fn, logits, targets) <= size + 1024
    plain = _saved_bytes(lambda x, t: F.cross_entropy(x.flatten(0, 1).float(), t.flatten()), logits, targets)
    assert plain >= 2 * size  # what the trainer's loss would keep without its own kernel


def test_rmsnorm_is_torchs_kernel(monkeypatch):
    """mmm's RMSNorm calls ``F.rms_norm`` (a fused kernel on CUDA; on CPU torch decomposes it): the same
    values as the hand-written fp32 form."""
    norm = RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 8, 64)
    xf = x.float()
    by_hand = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) * norm.weight
    calls = []
    kernel = F.rms_norm
    monkeypatch.setattr(F, "rms_norm", lambda *a, **k: calls.append(a[1]) or kernel(*a, **k))
    assert torch.allclose(norm(x), by_hand, rtol=1e-6, atol=1e-6)
    assert calls == [(64,)]


def test_adamw_is_fused_where_it_can_be():
    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = adamw(params, lr=1e-3)
    assert implementation(opt) == "fused"
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the CPU kernel runs
    # the caller's choice is kept
    assert implementation(adamw(params, lr=1e-3, foreach=True)) == "foreach"
    # reasons it is not taken
    assert "not floating point" in fused_problem([torch.zeros(2, dtype=torch.long)])
    assert "no fused kernel on meta" in fused_problem([torch.zeros(2, device="meta")])
    assert implementation(adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=1e-3)) == "default"


def test_a_resume_keeps_this_runs_adamw_implementation():
    """torch's load_state_dict copies every param-group key, ``fused`` too: a state saved unfused (every
    checkpoint before fused AdamW) would resume unfused. The checkpointer puts this run's choice back."""
    from mmm.parallel.checkpoint import keep_implementation

    params = [torch.nn.Parameter(torch.randn(4, 4))]
    params[0].grad = torch.ones(4, 4)
    saved = torch.optim.AdamW(params, lr=1e-3)
    saved.step()
    opt = adamw(params, lr=1e-3)
    opt.load_state_dict(saved.state_dict())
    assert implementation(opt) != "fused"  # what torch leaves
    keep_implementation(opt)
    assert implementation(opt) == "fused"
    opt.step()


def test_float8_converts_the_blocks_and_leaves_head_and_router():
    """torchao's Float8Linear in place of the blocks' linear layers (their matmuls then differ from
    bf16's: float8 is on), the output head and a mixture's router left as they are; a device without
    float8 matmuls refused in one line."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao, or mmm[float8])")
    from mmm.models.llama.model import Llama, LlamaConfig
    from mmm.parallel.float8 import apply_float8, float8_device_problem

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, seq_len=32, moe_experts=16)
    plain = Llama(cfg).to(torch.bfloat16)
    model = Llama(cfg).to(torch.bfloat16)
    model.load_state_dict(plain.state_dict())
    converted = apply_float8(model)
    assert "layers.0.attention.wq" in converted and not any(".router" in n or n == "output" for n in converted)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["output"] == "Linear" and kinds["layers.0.moe.router.gate"] == "Linear"
    assert kinds["layers.0.attention.wq"] == "Float8Linear"
    tokens = torch.randint(0, 128, (2, 32))
    a, b = model(tokens), plain(tokens)
    assert a.shape == b.shape and torch.isfinite(a.float()).all()
    assert not torch.equal(a, b)  # the matmuls really ran in float8
    assert (a.float() - b.float()).abs().max() < 0.5  # and close to bf16's
    assert "this run's device is cpu" in float8_device_problem(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_experts_equal_the_loop(dtype):
    """The experts as three grouped matmuls (``F.grouped_mm``, groups padded to 16 rows, an expert with no
    token among them) give the loop's outputs and gradients: to rounding in fp32, bit for bit here in bf16.
    On CPU the loop is the default (grouped: CUDA 9.0+)."""
    from mmm.models.llama.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(4, 32, 48)
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.1)
    experts = experts.to(dtype)
    counts = [5, 0, 17, 3]
    x = torch.randn(sum(counts), 32, dtype=dtype)
    assert experts.grouped is None and not grouped_mm_available(x)
    got = {}
    for grouped in (False, True):
        experts.grouped = grouped
        xi = x.clone().requires_grad_()
        out = experts(xi, counts)
        grads = torch.autograd.grad(out.float().square().sum(), [xi, experts.w1, experts.w2, experts.w3])
        got[grouped] = (out, *grads)
    for loop, grouped in zip(got[False], got[True]):
        assert torch.allclose(grouped.float(), loop.float(), rtol=1e-5, atol=1e-5 * loop.float().abs().max().item())


def test_grouped_experts_need_nothing_from_the_host(monkeypatch):
    """Without expert parallel, grouped experts take the routing's counts on the device: a mixture's forward
    reads no routing-dependent value on the host (each such read waits for the device on CUDA), where the
    loop reads the counts once per layer. Both give the same loss."""
    from mmm.models.llama.model import Llama, LlamaConfig
    from mmm.models.llama.moe import GroupedExperts

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, seq_len=32, moe_experts=4))
    tokens = torch.randint(0, 128, (2, 32))
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    losses = {}
    for grouped in (False, True):
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.grouped = grouped
        reads.clear()
        losses[grouped] = loss_fn(model(tokens), tokens)
        assert len(reads) == (0 if grouped else 2), (grouped, reads)
    assert losses[True].item() == pytest.approx(losses[False].item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hugging_face_experts_run_grouped_as_their_loop(dtype, monkeypatch):
    """A Hugging Face experts module (Qwen3-MoE's: packed gate_up_proj, its own activation) under mmm's
    sorted-token forward (the one expert parallel sends through its all-to-all) as two grouped matmuls gives
    the loop's outputs and gradients (an expert without tokens among them); the loop is the default here."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from mmm.parallel.experts import _HFExpertsForward, _LocalExperts

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=4)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    for w in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(w, std=0.1)
    experts = experts.to(dtype)
    tokens, k = 13, 2
    index = torch.stack([torch.tensor([0, 2, 3])[torch.arange(tokens) % 3], torch.full((tokens,), 3)], dim=1)
    weights = torch.rand(tokens, k, dtype=dtype)  # expert 1 gets no token
    x = torch.randn(tokens, 32, dtype=dtype)
    forward = _HFExpertsForward(experts, _LocalExperts())
    assert forward.grouped is None and not grouped_mm_available(x)
    calls, real = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = {}
    for grouped in (False, True):
        forward.grouped = grouped
        xi = x.clone().requires_grad_()
        calls.clear()
        out = forward(xi, index, weights)
        assert len(calls) == (2 if grouped else 0), (grouped, calls)  # really grouped, or really the loop
        grads = torch.autograd.grad(out.float().square().sum(), [xi, experts.gate_up_proj, experts.down_proj])
        got[grouped] = (out, *grads)
    for loop, grouped in zip(got[False], got[True]):
        assert torch.allclose(grouped.float(), loop.float(), rtol=1e-5, atol=1e-5 * loop.float().abs().max().item())
