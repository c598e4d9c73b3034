"""Check a model and a layout against one process before a long run: per-step loss AND global
gradient norm, side by side, with a clear PASS/FAIL.

    launch -n 4 python3 -m mmm.verify --model llama --tp 2                 # mmm's Llama, dp 2 x tp 2
    launch -n 4 python3 -m mmm.verify --model hf-llama --pp 2              # transformers' LlamaForCausalLM
    launch -n 4 python3 -m mmm.verify --model mypkg.models:build --tp-plan mypkg.models:TP_PLAN --tp 2

``--model`` is ``llama``, ``vit``, ``hf-llama`` or ``module:function`` (a function of no arguments
returning your ``nn.Module``; a language model taking tokens and returning logits, or an object
with ``.logits``). The same seed gives every rank, and the one-process reference, the same
weights; each step's global batch depends only on the step; each dp rank trains its slice.
Rank 0 trains the reference in plain PyTorch (no mmm parallelism), the mesh trains through
:func:`mmm.parallel.parallelize` (or :func:`mmm.parallel.build_pipeline` with ``--pp``), and the
table shows both. Exit 0 only when every step agrees within ``--rtol`` (fp32 default 1e-5).

As a function: :func:`verify`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmm.cli import ArgumentParser, add_mesh_args, positive_int
from mmm.errors import RunError, UsageError

BUILTIN = ("llama", "vit", "hf-llama")


@dataclass
class Verdict:
    """Per-step losses and gradient norms of the one-process reference and of the mesh."""

    ref_loss: list[float]
    ref_grad_norm: list[float]
    loss: list[float]
    grad_norm: list[float]
    rtol: float
    layout: str = ""
    diffs: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def rel(a, b):
            return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

        self.diffs = {"loss": rel(self.loss, self.ref_loss), "grad_norm": rel(self.grad_norm, self.ref_grad_norm)}

    @property
    def passed(self) -> bool:
        return all(math.isfinite(d) and d <= self.rtol for d in self.diffs.values())

    def table(self) -> str:
        head = (
            "step",
            "loss (1 process)",
            "loss (mesh)",
            "rel diff",
            "grad norm (1 process)",
            "grad norm (mesh)",
            "rel diff",
        )
        rows = [head]
        for i, (a, b, c, d) in enumerate(zip(self.ref_loss, self.loss, self.ref_grad_norm, self.grad_norm), 1):
            rows.append(
                (
                    str(i),
                    f"{a:.7f}",
                    f"{b:.7f}",
                    f"{abs(b - a) / max(abs(a), 1e-12):.1e}",
                    f"{c:.7f}",
                    f"{d:.7f}",
                    f"{abs(d - c) / max(abs(c), 1e-12):.1e}",
                )
            )
        widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
        lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(
            f"{verdict}: {self.layout} max rel diff loss {self.diffs['loss']:.1e}, grad norm "
            f"{self.diffs['grad_norm']:.1e} (tolerance {self.rtol:g})"
        )
        return "\n".join(lines)


def _logits(out):
    return getattr(out, "logits", out)


def lm_loss(logits, targets):
    """Next-token cross entropy (logits may be a model output with ``.logits``)."""
    import torch.nn.functional as F

    logits = _logits(logits)
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def token_batches(vocab_size: int, seq_len: int, batch: int, seed: int = 0):
    """``step -> (inputs, targets)``: random tokens, the global batch a function of the step only."""
    import torch

    def get(step: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    return get


def verify(
    model_fn: Callable[[], Any],
    mesh,
    spec=None,
    *,
    batch_fn: Callable[[int], tuple],
    loss_fn: Callable,
    steps: int = 3,
    lr: float = 1e-3,
    seed: int = 0,
    rtol: float = 1e-5,
    microbatches: int | None = None,
    pp_schedule: str = "1f1b",
    stages_per_rank: int = 1,
    device=None,
) -> Verdict:
    """Train ``model_fn()`` for ``steps`` AdamW steps in one process (rank 0) and on ``mesh`` with
    ``spec``, on the global batches ``batch_fn(step)`` (each dp rank its slice), and compare the
    per-step loss and global gradient norm. Collective: call it on every rank. Every rank gets the
    same :class:`Verdict`."""
    import torch
    import torch.distributed as tdist

    from mmm.dist import current
    from mmm.parallel import ParallelSpec, build_pipeline, clip_grad_norm_, compose_problems, parallelize
    from mmm.training import mean_over

    spec = spec or ParallelSpec()
    problems = compose_problems(spec, mesh.dims)  # before the reference run, not after it
    if mesh.pp_enabled:
        from mmm.parallel.compose import find_blocks, get_submodule
        from mmm.parallel.pipeline import pipeline_problems

        with torch.device("meta"):  # only the block count is needed
            shape = model_fn()
        blocks = find_blocks(shape, spec.blocks)
        n_blocks = len(get_submodule(shape, blocks)) if blocks else 0
        problems += pipeline_problems(
            pp=mesh.pp,
            n_layers=n_blocks,
            schedule=pp_schedule,
            stages_per_rank=stages_per_rank,
            microbatches=microbatches or mesh.pp,
        )
    if problems:
        raise UsageError("; ".join(problems))
    device = device or (current().device if current() is not None else torch.device("cpu"))
    if mesh.cp_enabled:
        raise UsageError(
            "verify does not run context parallel (cp > 1): a model's positions must be sharded "
            "its own way; check CP with the trainer (python -m mmm.examples.fsdp_tp --cp N)"
        )
    rank = tdist.get_rank() if tdist.is_initialized() else 0

    ref = torch.zeros(2, steps, dtype=torch.float64)
    if rank == 0:
        torch.manual_seed(seed)
        model = model_fn().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in range(1, steps + 1):
            inputs, targets = (t.to(device) for t in batch_fn(step))
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            ref[0, step - 1] = loss.item()
            ref[1, step - 1] = clip_grad_norm_(model.parameters(), 0.0)
            opt.step()
            opt.zero_grad()
        del model, opt
    if tdist.is_initialized():  # on the device: NCCL has no CPU tensors
        ref = ref.to(device)
        tdist.broadcast(ref, src=0)
        ref = ref.cpu()

    torch.manual_seed(seed)
    model = model_fn().to(device)
    pipe = None
    if mesh.pp_enabled:
        pipe = build_pipeline(
            model,
            mesh,
            spec,
            loss_fn=loss_fn,
            microbatches=microbatches,
            schedule=pp_schedule,
            stages_per_rank=stages_per_rank,
            device=device,
        )
        model = pipe.module
    else:
        model = parallelize(model, mesh, spec, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(1, steps + 1):
        inputs, targets = batch_fn(step)
        if inputs.shape[0] % mesh.dp:
            raise UsageError(
                f"the global batch of {inputs.shape[0]} does not split over {mesh.dp} data-parallel "
                f"ranks; use a multiple of {mesh.dp}"
            )
        dp_rank, local = mesh.coord("dp"), inputs.shape[0] // mesh.dp
        inputs, targets = (t[dp_rank * local : (dp_rank + 1) * local].to(device) for t in (inputs, targets))
        if pipe is not None:
            loss = pipe.step(inputs, targets)
        else:
            from mmm.parallel.tensor import loss_parallel_context

            with loss_parallel_context(spec.loss_parallel and mesh.tp_enabled):
                loss = loss_fn(model(inputs), targets)
                loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), 0.0, pp_group=mesh.group("pp")))
        losses.append(mean_over(loss, mesh.group("dp")))
        opt.step()
        opt.zero_grad()
    layout = " x ".join(f"{a}={mesh.size(a)}" for a in ("pp", "dp", "tp") if mesh.size(a) > 1) or "1 rank"
    return Verdict(ref[0].tolist(), ref[1].tolist(), losses, norms, rtol=rtol, layout=f"{layout}, dp={spec.dp}")


# --------------------------------------------------------------------------- command line
def build_parser() -> ArgumentParser:
    from mmm.parallel.activation_checkpoint import AC_MODES
    from mmm.parallel.pipeline import SCHEDULES

    p = ArgumentParser(
        prog="python -m mmm.verify", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2]
    )
    p.add_argument("--model", default="llama", help=f"{', '.join(BUILTIN)} or module:function [llama]")
    p.add_argument(
        "--tp-plan",
        default=None,
        metavar="module:NAME",
        help="the TP plan (a dict of module-name patterns) for a module:function model",
    )
    p.add_argument("--blocks", default="auto", help="path of the repeated blocks [auto]")
    add_mesh_args(p)
    g = p.add_argument_group("what to check")
    g.add_argument("--strategy", choices=["fsdp", "hsdp", "ddp"], default="fsdp", help="data parallel [fsdp]")
    g.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing [none]")
    g.add_argument("--microbatches", type=positive_int, default=None, help="pipeline microbatches [pp]")
    g.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b", help="pipeline schedule [1f1b]")
    g.add_argument(
        "--stages-per-rank",
        type=positive_int,
        default=1,
        help="pipeline stages per rank (interleaved schedules need 2 or more) [1]",
    )
    g.add_argument("--steps", type=positive_int, default=3, help="AdamW steps [3]")
    g.add_argument("--batch-size", type=positive_int, default=8, help="GLOBAL batch [8]")
    g.add_argument("--seq-len", type=positive_int, default=32, help="tokens per sequence [32]")
    g.add_argument("--vocab-size", type=positive_int, default=128, help="token ids are drawn below this [128]")
    g.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate [1e-3]")
    g.add_argument("--seed", type=int, default=0, help="seed of weights and data [0]")
    g.add_argument("--rtol", type=float, default=1e-5, help="largest relative difference that passes [1e-5]")
    return p


def _load(ref: str, what: str):
    module, _, name = ref.partition(":")
    if not module or not name:
        raise UsageError(f"{what} {ref!r} is not module:name (e.g. mypkg.models:build)")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{what} {ref!r}: {e}") from None


def target(args):
    """(model factory, spec options, batch_fn, loss_fn) for the flags."""
    import torch.nn.functional as F

    if args.model == "llama":
        from mmm.models.llama import Llama, LlamaConfig
        from mmm.parallel.tensor import llama_tp_plan

        cfg = LlamaConfig(dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=args.vocab_size, seq_len=args.seq_len)
        return (
            (lambda: Llama(cfg)),
            {"tp_plan": llama_tp_plan(), "loss_parallel": True},
            token_batches(args.vocab_size, args.seq_len, args.batch_size, args.seed),
            lm_loss,
        )
    if args.model == "vit":
        import torch

        from mmm.models.vit import ViT, ViTConfig
        from mmm.parallel.tensor import VIT_TP_PLAN

        cfg = ViTConfig(img_size=16, patch_size=4, depth=4, num_heads=4, head_dim=8)

        def images(step):
            g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            return torch.randn(args.batch_size, 3, 16, 16, generator=g), torch.randint(
                0, 10, (args.batch_size,), generator=g
            )

        return (
            (lambda: ViT(cfg)),
            {"tp_plan": VIT_TP_PLAN},
            images,
            (lambda logits, y: F.cross_entropy(logits.float(), y)),
        )
    if args.model == "hf-llama":
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            raise UsageError("--model hf-llama needs transformers: pip install 'mmm[hf]'") from None
        from mmm.parallel.tensor import HF_LLAMA_TP_PLAN

        config = LlamaConfig(
            vocab_size=args.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq_len,
            use_cache=False,
        )
        return (
            (lambda: LlamaForCausalLM(config)),
            {"tp_plan": HF_LLAMA_TP_PLAN},
            token_batches(args.vocab_size, args.seq_len, args.batch_size, args.seed),
            lm_loss,
        )
    factory = _load(args.model, "--model")
    plan = _load(args.tp_plan, "--tp-plan") if args.tp_plan else None
    return factory, {"tp_plan": plan}, token_batches(args.vocab_size, args.seq_len, args.batch_size, args.seed), lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    from mmm import dist
    from mmm.log import get_logger
    from mmm.parallel import ParallelSpec, init_mesh

    args = build_parser().parse_args(argv)
    info = dist.setup(seed=args.seed)
    if args.model not in BUILTIN and ":" not in args.model:
        raise UsageError(f"--model {args.model!r}: use one of {', '.join(BUILTIN)}, or module:function")
    if args.cp != 1:
        raise UsageError(
            f"--cp {args.cp}: verify does not run context parallel; check it with python -m mmm.examples.fsdp_tp --cp N"
        )
    mesh = init_mesh(
        tp=args.tp, pp=args.pp, dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, log_coordinates=False
    )
    model_fn, options, batch_fn, loss_fn = target(args)
    spec = ParallelSpec(blocks=args.blocks, ac=args.ac, dp=args.strategy, **options)
    verdict = verify(
        model_fn,
        mesh,
        spec,
        batch_fn=batch_fn,
        loss_fn=loss_fn,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        rtol=args.rtol,
        microbatches=args.microbatches,
        pp_schedule=args.pp_schedule,
        stages_per_rank=args.stages_per_rank,
        device=info.device,
    )
    if info.is_main:
        get_logger().info(
            "verify %s on %d ranks against one process:\n%s", args.model, info.world_size, verdict.table()
        )
    if not verdict.passed:
        raise RunError(
            f"{verdict.layout} does not match one process: max rel diff loss "
            f"{verdict.diffs['loss']:.1e}, grad norm {verdict.diffs['grad_norm']:.1e} > {args.rtol:g}"
        )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog="python -m mmm.verify")
