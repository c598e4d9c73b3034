"""Check a model and a layout against one process before a long run: per-step loss AND global
gradient norm, side by side, with a clear PASS/FAIL.

    launch -n 4 python3 -m mmm.verify --model llama --tp 2                 # mmm's Llama, dp 2 x tp 2
    launch -n 4 python3 -m mmm.verify --model hf-llama --pp 2              # transformers' LlamaForCausalLM
    launch -n 4 python3 -m mmm.verify --model llama --cp 4 --cp-attention ulysses   # all-to-all context parallel
    launch -n 4 python3 -m mmm.verify --model llama-moe --ep 2             # mixture of experts, expert parallel
    launch -n 4 python3 -m mmm.verify --model mypkg.models:build --tp-plan mypkg.models:TP_PLAN --tp 2

``--model`` is ``llama``, ``llama-moe``, ``vit``, ``hf-llama`` or ``module:NAME``: a function of no arguments
returning your ``nn.Module`` (a language model taking tokens and returning logits, or an object
with ``.logits``), or a recipe (:class:`mmm.training.recipe.Recipe`: its model at its defaults, its
TP plan and loss, random batches shaped as its own). The same seed gives every rank, and the
one-process reference, the same weights; each step's global batch depends only on the step; each
dp rank trains its slice. Rank 0 trains the reference in plain PyTorch (no mmm parallelism), the mesh trains through
:func:`mmm.parallel.parallelize` (or :func:`mmm.parallel.build_pipeline` with ``--pp``), and the
table shows both. Exit 0 only when every step agrees within ``--rtol`` (fp32 default 1e-5).

As a function: :func:`verify`.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn.functional as F

from mmm import dist
from mmm.cli import FLAGS, ArgumentParser, Flags, nonnegative_float, option, override, positive_int, random_seed
from mmm.data import step_seed
from mmm.dist import current
from mmm.errors import RunError, Spelling, UsageError
from mmm.log import get_logger, quiet_torchao
from mmm.models.hf import HF_LLAMA_TP_PLAN
from mmm.models.llama import Llama, LlamaConfig, llama_tp_plan
from mmm.models.vit import VIT_TP_PLAN, ViT, ViTConfig
from mmm.parallel import (
    ParallelSpec,
    build_pipeline,
    clip_grad_norm_,
    compose_problems,
    init_mesh,
    meta_init,
    parallelize,
)
from mmm.parallel.accumulate import accumulation_problems, deferred_gradient_sync, scale_gradients_, split_batch
from mmm.parallel.compose import ac_problems, find_blocks, get_submodule
from mmm.parallel.context import context_parallel, cp_problems, shard_sequence
from mmm.parallel.experts import hf_ep_plan
from mmm.parallel.mesh import AXES
from mmm.parallel.pipeline import pipeline_problems
from mmm.parallel.tensor import hf_experts_plan, hf_tp_plan, loss_parallel_context
from mmm.training import mean_over
from mmm.training.config import Config, ParallelConfig
from mmm.training.recipe import Recipe

BUILTIN = ("llama", "llama-moe", "vit", "hf-llama")
# how verify's checks name what they refuse: :func:`verify`'s keyword arguments (its schedule is pp_schedule;
# it takes no split points) and the command line's flags; a block count is the model's, not a setting
_BLOCKS = {"n_layers": "the model's {} blocks"}
KEYWORDS = Spelling(keywords={"schedule": "pp_schedule", "split_points": ""}, facts=_BLOCKS)
VERIFY_FLAGS = Spelling(flags={**FLAGS.flags, "split_points": ""}, facts=_BLOCKS)


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
    logits = _logits(logits)
    if not isinstance(logits, torch.Tensor):
        raise UsageError(
            f"the model returned a {type(logits).__name__}, not the logits (a tensor of batch x seq x vocabulary) "
            "or an object with .logits; make its forward return the logits (e.g. wrap it: return self.inner(x)[0])"
        )
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


CANNOT_TAKE = "the model cannot take the batches"


def _embeddings_checked(model: torch.nn.Module, inputs: torch.Tensor) -> list:
    """Hooks that refuse, in one line, ids past an embedding's rows (token ids past the vocabulary, positions
    past the table) before the lookup: on a CPU an IndexError from inside torch, on a GPU a device-side
    assert. Remove them after the first forward."""

    def check(name: str):
        def hook(module, args):
            ids = args[0] if args else None
            if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.numel():
                low, high = int(ids.min()), int(ids.max())
                if low < 0 or high >= module.num_embeddings:
                    raise UsageError(
                        f"{CANNOT_TAKE}: {name} (an embedding of {module.num_embeddings} rows) is given ids "
                        f"{low}-{high} (inputs of shape {tuple(inputs.shape)}); give batches within its vocabulary "
                        "and positions"
                    )

        return hook

    return [
        m.register_forward_pre_hook(check(name or type(model).__name__))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding)
    ]


def _tp_problem(e: Exception, mesh) -> str | None:
    """The line for a TP plan that leaves a layer's input the wrong shape (a colwise layer without its rowwise
    partner, a plan that splits one layer of a pair), None for any other failure."""
    if not (mesh.tp_enabled and isinstance(e, RuntimeError) and "shapes cannot be multiplied" in str(e)):
        return None
    return (
        f"with tp={mesh.tp} a layer got an input of the wrong shape ({str(e).splitlines()[0]}): the TP plan splits "
        "a layer whose partner it leaves whole (each colwise layer needs the rowwise one that takes its output, "
        "and norms between them stay unsplit); check the plan against the model's forward"
    )


def token_batches(vocab_size: int, seq_len: int, batch: int, seed: int = 0):
    """``step -> (inputs, targets)``: random tokens, the global batch a function of the step only."""

    def get(step: int):
        g = torch.Generator().manual_seed(step_seed(seed, step))
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
    cp_attention: str = "ring",
    device=None,
    spell: Spelling = KEYWORDS,
) -> Verdict:
    """Train ``model_fn()`` for ``steps`` AdamW steps in one process (rank 0) and on ``mesh`` with
    ``spec``, on the global batches ``batch_fn(step)`` (each dp rank its slice), and compare the
    per-step loss and global gradient norm. Collective: call it on every rank. Every rank gets the
    same :class:`Verdict`.

    ``microbatches``: a pipeline's (default pp); without one, gradient accumulation over as many parts of
    each rank's batch (:mod:`mmm.parallel.accumulate`), against the one process's whole batch.

    Context parallel (``cp_attention`` ring or ulysses) needs a model with the ``attn_fn`` hook and a
    ``shard_positions(positions)`` method (:func:`mmm.parallel.context.context_parallel`): each cp rank
    then trains its load-balanced share of every sequence. ``spell``: how refusals name the settings
    (:data:`VERIFY_FLAGS`: the command line's flags)."""
    spec = spec or ParallelSpec()
    problems = compose_problems(spec, mesh.dims)  # before the reference run, not after it
    if mesh.pp_enabled:
        with torch.device("meta"):  # only the block count is needed
            shape = model_fn()
        blocks = find_blocks(shape, spec.blocks)
        n_blocks = len(get_submodule(shape, blocks)) if blocks else 0
        global_batch = batch_fn(1)[0].shape[0]
        problems += pipeline_problems(
            pp=mesh.pp,
            n_layers=n_blocks,
            schedule=pp_schedule,
            stages_per_rank=stages_per_rank,
            microbatches=mesh.pp if microbatches is None else microbatches,
            local_batch=global_batch // mesh.dp if global_batch % mesh.dp == 0 else None,
            spell=spell,
        )
        problems += [p for p in ac_problems(spec.ac, mesh.dims, schedule=pp_schedule, spell=spell) if p not in problems]
    elif microbatches is not None:  # gradient accumulation over parts of each rank's batch
        global_batch = batch_fn(1)[0].shape[0]
        problems += accumulation_problems(
            microbatches, global_batch // mesh.dp if global_batch % mesh.dp == 0 else None, spell=spell
        )
    seq_len = 0
    if mesh.cp_enabled:
        example = batch_fn(1)[0]
        if example.dim() != 2 or example.is_floating_point():
            problems.append(
                f"cp={mesh.cp}: context parallel splits token sequences (batch, seq) of a causal language model; "
                f"this model's inputs are {example.dtype} of shape {tuple(example.shape)}"
            )
        else:
            seq_len = example.shape[1]
            problems += cp_problems(cp=mesh.cp, seq_len=seq_len, tp=mesh.tp, kind=cp_attention)
    if problems:
        raise UsageError("; ".join(problems))
    device = device or (current().device if current() is not None else torch.device("cpu"))
    rank = tdist.get_rank() if tdist.is_initialized() else 0

    ref = torch.zeros(2, steps, dtype=torch.float64)
    refused = [None]  # rank 0's one line for a model that cannot take the batches, or its loss's refusal
    if rank == 0:
        torch.manual_seed(seed)
        model = model_fn().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        for step in range(1, steps + 1):
            inputs, targets = (t.to(device) for t in batch_fn(step))
            hooks = _embeddings_checked(model, inputs) if step == 1 else []
            try:  # (any other error is a bug of the model's or its loss: its traceback; the others lose contact)
                loss = loss_fn(model(inputs), targets)
            except UsageError as e:
                refused[0] = str(e)
                break
            finally:
                for h in hooks:
                    h.remove()
            loss.backward()
            ref[0, step - 1] = loss.item()
            ref[1, step - 1] = clip_grad_norm_(model.parameters(), 0.0)
            opt.step()
            opt.zero_grad()
        del model, opt
    if tdist.is_initialized():  # every rank learns whether the reference ran (NCCL: through this device)
        tdist.broadcast_object_list(refused, src=0, device=None if torch.device(device).type == "cpu" else device)
    if refused[0] is not None:
        raise UsageError(refused[0])
    if tdist.is_initialized():  # on the device: NCCL has no CPU tensors
        ref = ref.to(device)
        tdist.broadcast(ref, src=0)
        ref = ref.cpu()

    torch.manual_seed(seed)
    model = model_fn().to(device)
    if mesh.cp_enabled:  # ring or all-to-all attention in its hooks, this rank's positions
        context_parallel(model, mesh["cp"], kind=cp_attention, seq_len=seq_len)
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
    forwards = [0]  # the model's forward passes (the verdict says how many a step took: accumulation's parts)
    counter = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    for step in range(1, steps + 1):
        inputs, targets = batch_fn(step)
        if inputs.shape[0] % mesh.dp:
            raise UsageError(
                f"the global batch of {inputs.shape[0]} does not split over {mesh.dp} data-parallel "
                f"ranks; use a multiple of {mesh.dp}"
            )
        dp_rank, local = mesh.coord("dp"), inputs.shape[0] // mesh.dp
        inputs, targets = (t[dp_rank * local : (dp_rank + 1) * local].to(device) for t in (inputs, targets))
        if mesh.cp_enabled:
            cp_rank = mesh.coord("cp")
            inputs, targets = (shard_sequence(t, cp_rank, mesh.cp) for t in (inputs, targets))
        if pipe is not None:
            loss = pipe.step(inputs, targets)
        else:  # with microbatches, gradient accumulation: the gradients and loss are the parts' mean
            n, loss = microbatches or 1, 0.0
            with loss_parallel_context(spec.loss_parallel and mesh.tp_enabled):
                for i, (x, y) in enumerate(split_batch(inputs, targets, n)):
                    with deferred_gradient_sync(model, last=i == n - 1):
                        try:
                            out = model(x)
                        except RuntimeError as e:  # every rank of the layout fails alike: one line on each
                            problem = _tp_problem(e, mesh) if step == 1 else None
                            if problem is None:
                                raise
                            raise UsageError(problem) from None
                        part = loss_fn(out, y)
                        part.backward()
                    loss = loss + part.detach() / n
            scale_gradients_(model.parameters(), 1 / n)
        norms.append(clip_grad_norm_(model.parameters(), 0.0, pp_group=mesh.group("pp")))
        losses.append(mean_over(loss, mesh.group("dp_cp")))
        opt.step()
        opt.zero_grad()
    counter.remove()
    dp = ("dp_replicate", "dp_shard") if mesh.size("dp_replicate") > 1 else ("dp",)  # HSDP: both of its axes
    axes = ("pp", *dp, "cp", "tp", "ep")
    layout = " x ".join(f"{a}={mesh.size(a)}" for a in axes if mesh.size(a) > 1) or "1 rank"
    layout += f" ({cp_attention} attention)" if mesh.cp_enabled else ""
    if pipe is None and (microbatches or 1) > 1:  # counted, not taken from the argument
        layout += f", gradient accumulation: {forwards[0] / steps:g} forward passes a step"
    layout += f", dp={spec.dp}" + (f", ac={spec.ac}" if spec.ac != "none" else "")
    return Verdict(ref[0].tolist(), ref[1].tolist(), losses, norms, rtol=rtol, layout=layout)


# --------------------------------------------------------------------------- command line
@dataclass
class VerifyConfig:
    """What to verify: the model, its TP plan and blocks, and the short run both sides train."""

    model: str = option(
        "llama",
        "--model",
        group="check",
        help=f"{', '.join(BUILTIN)}, or module:NAME (a function returning your model, or a recipe)",
        metavar="MODEL",
    )
    tp_plan: str | None = option(
        None,
        "--tp-plan",
        metavar="module:NAME",
        group="check",
        help="the TP plan (a dict of module-name patterns) for a module:function model",
    )
    ep_plan: str | None = option(
        None,
        "--ep-plan",
        metavar="module:NAME",
        group="check",
        help="the experts plan (a dict naming the experts modules) for a module:function model under --ep",
    )
    blocks: str = option("auto", "--blocks", group="check", help="path of the repeated blocks")
    steps: int = option(3, "--steps", parse=positive_int, group="check", help="AdamW steps")
    batch_size: int = option(8, "--batch-size", parse=positive_int, group="check", help="GLOBAL batch")
    seq_len: int = option(32, "--seq-len", parse=positive_int, group="check", help="tokens per sequence")
    vocab_size: int = option(
        128, "--vocab-size", parse=positive_int, group="check", help="token ids are drawn below this"
    )
    lr: float = option(1e-3, "--lr", parse=nonnegative_float, group="check", help="AdamW learning rate")
    seed: int = option(0, "--seed", parse=random_seed, group="check", help="seed of weights and data")
    rtol: float = option(
        1e-5, "--rtol", parse=nonnegative_float, group="check", help="largest relative difference that passes"
    )


@dataclass
class VerifyParallel(ParallelConfig):
    """The layouts verify checks: the torch strategies (DeepSpeed's ZeRO has no one-process twin here)."""

    strategy: str = override(ParallelConfig, "strategy", choices=("fsdp", "hsdp", "ddp"), help="data parallel")


COMMAND_LINE = Flags(
    prog="python -m mmm.verify",
    doc=__doc__,
    sections={
        "check": (VerifyConfig, None),
        "parallel": (
            VerifyParallel,
            (*AXES, "ep", "cp_attention", "strategy", "ac", "microbatches", "pp_schedule", "stages_per_rank"),
        ),
    },
    titles={"check": "what to check"},
)


def build_parser() -> ArgumentParser:
    return COMMAND_LINE.parser()


def _load(ref: str, what: str):
    module, _, name = ref.partition(":")
    if not module or not name:
        raise UsageError(f"{what} {ref!r} is not module:name (e.g. mypkg.models:build)")
    quiet_torchao()  # a module that imports transformers
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{what} {ref!r}: {e}") from None


def target(check: VerifyConfig, par: ParallelConfig | None = None, world: int = 1):
    """(model factory, spec options, batch_fn, loss_fn) for what ``check`` names (a recipe's own checks of
    the layout ``par`` on ``world`` ranks first)."""
    tokens = token_batches(check.vocab_size, check.seq_len, check.batch_size, check.seed)
    if check.model in BUILTIN:  # their TP plans are their own; the ViT's batches are 16 x 16 images of 10 classes
        defaults = VerifyConfig()
        flags = {"--tp-plan": "tp_plan", "--ep-plan": "ep_plan"} | (
            {"--seq-len": "seq_len", "--vocab-size": "vocab_size"} if check.model == "vit" else {}
        )
        given = [
            f"{flag} {getattr(check, name)}"
            for flag, name in flags.items()
            if getattr(check, name) != getattr(defaults, name)
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)}: --model {check.model} has its own TP plan"
                f"{' and trains on 16 x 16 images of 10 classes, not tokens' if check.model == 'vit' else ''}; "
                f"drop {'it' if len(given) == 1 else 'them'}"
            )
    if check.model in ("llama", "llama-moe"):
        moe = check.model == "llama-moe"  # 8 experts, top-2, one shared; the sequence-wise balance loss
        cfg = LlamaConfig(
            dim=64, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=check.vocab_size, seq_len=check.seq_len
        )
        if moe:
            cfg = LlamaConfig(**{**vars(cfg), "moe_experts": 8, "moe_top_k": 2, "moe_shared": 1, "moe_aux": 1e-2})
        options = {"tp_plan": llama_tp_plan(moe=moe, shared=moe), "loss_parallel": True}
        if moe:
            options["ep_plan"] = {"layers.*.moe.experts": "experts"}
        return (lambda: Llama(cfg)), options, tokens, lm_loss
    if check.model == "vit":
        cfg = ViTConfig(img_size=16, patch_size=4, depth=4, num_heads=4, head_dim=8)

        def images(step):
            g = torch.Generator().manual_seed(step_seed(check.seed, step))
            return torch.randn(check.batch_size, 3, 16, 16, generator=g), torch.randint(
                0, 10, (check.batch_size,), generator=g
            )

        return (
            (lambda: ViT(cfg)),
            {"tp_plan": VIT_TP_PLAN},
            images,
            (lambda logits, y: F.cross_entropy(logits.float(), y)),
        )
    if check.model == "hf-llama":
        quiet_torchao()
        try:
            from transformers import LlamaConfig as HFLlamaConfig
            from transformers import LlamaForCausalLM
        except ImportError:
            raise UsageError("--model hf-llama needs transformers: pip install 'mmm[hf]'") from None

        config = HFLlamaConfig(
            vocab_size=check.vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=check.seq_len,
            use_cache=False,
        )
        return (lambda: LlamaForCausalLM(config)), {"tp_plan": HF_LLAMA_TP_PLAN}, tokens, lm_loss
    factory = _load(check.model, "--model")
    if isinstance(factory, Recipe):
        defaults = VerifyConfig()
        flags = {"--tp-plan": "tp_plan", "--ep-plan": "ep_plan", "--seq-len": "seq_len", "--vocab-size": "vocab_size"}
        given = [flag for flag, name in flags.items() if getattr(check, name) != getattr(defaults, name)]
        if given:
            raise UsageError(
                f"{', '.join(given)}: {check.model} is a recipe, whose model (at its defaults), TP plan and batch "
                "shapes are its own; drop them"
            )
        problems = recipe_problems(factory, check, par or ParallelConfig(), world)
        if problems:
            raise UsageError("; ".join(problems))
        return recipe_target(factory, check)
    plan = _load(check.tp_plan, "--tp-plan") if check.tp_plan else None
    experts = _load(check.ep_plan, "--ep-plan") if check.ep_plan else None
    return model_factory(factory, check.model), {"tp_plan": plan, "ep_plan": experts}, tokens, lm_loss


def model_factory(factory, ref: str) -> Callable[[], torch.nn.Module]:
    """``factory`` (what --model ``ref`` names) checked on every rank before any step: a function of no
    arguments that returns a ``torch.nn.Module`` (tried once on meta, no memory)."""
    what = f"--model {ref!r}"
    if not callable(factory):
        raise UsageError(f"{what} is a {type(factory).__name__}, not a function that returns your model")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        params = inspect.signature(factory).parameters.items()
        kinds = (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        needed = [n for n, p in params if p.default is p.empty and p.kind in kinds]
        raise UsageError(
            f"{what} needs arguments ({', '.join(needed)}); give a function of none that returns your model "
            "(e.g. def build(): return MyModel(config))"
        ) from None
    except ValueError:  # no signature to read (a builtin): the call below says
        pass
    try:
        with meta_init():
            probe = factory()
    except Exception:  # a factory that cannot run on meta: the real build below says why, with its traceback
        return factory
    if not isinstance(probe, torch.nn.Module):
        raise UsageError(f"{what} returned a {type(probe).__name__}, not a torch.nn.Module (your model)")
    return factory


def recipe_problems(recipe: Recipe, check: VerifyConfig, par: ParallelConfig, world: int) -> list[str]:
    """What the recipe's own :meth:`~mmm.training.recipe.Recipe.problems` says of its model at its defaults
    on the layout ``par`` with verify's global batch (a model that runs on no pipeline, say)."""
    train = recipe.config()
    if isinstance(getattr(train, "batch_size", None), int):
        train = replace(train, batch_size=check.batch_size)
    return recipe.problems(Config(train, parallel=par, recipe=recipe), world)


def recipe_target(recipe: Recipe, check: VerifyConfig):
    """(model factory, spec options, batch_fn, loss_fn) of a recipe's model at its defaults: random
    global batches of --batch-size shaped as the recipe's own (token ids or classes below the size
    of the model's output, other inputs normal)."""
    cfg = recipe.model_config(recipe.config())
    spec = recipe.spec(ParallelConfig(), cfg)
    inputs, targets = recipe.example_batch(cfg, rows=check.batch_size)
    with torch.device("meta"):
        classes = _logits(recipe.build(cfg)(inputs.to("meta"))).shape[-1]

    def random_like(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g, dtype=t.dtype)
        return torch.randint(0, classes, t.shape, generator=g, dtype=t.dtype)

    def batch(step: int):
        g = torch.Generator().manual_seed(step_seed(check.seed, step))
        return random_like(inputs, g), random_like(targets, g)

    options = {"tp_plan": spec.tp_plan, "loss_parallel": spec.loss_parallel, "ep_plan": spec.ep_plan}
    return (lambda: recipe.build(cfg)), options, batch, recipe.loss


def plan_missing(model: str, axis: str, n: int, what: str, example: str) -> str:
    """The line for ``--tp``/``--ep`` > 1 on a model with no such plan, with the fix its kind of model has."""
    if model in BUILTIN and axis == "ep":
        return f"--{axis} {n}: --model {model} has no experts to split; use --model llama-moe"
    if model.count(":") == 1 and isinstance(_load(model, "--model"), Recipe):
        return f"--{axis} {n}: the recipe {model} gives no {axis}_plan in its spec; use --{axis} 1"
    return f"--{axis} {n} needs {what} plan: give --{axis}-plan module:NAME ({example})"


def config_tp_plan(model_fn, say: bool) -> dict | None:
    """No --tp-plan for a model whose config carries one (a Hugging Face model's ``base_model_tp_plan``):
    use that plan, and say so. None when the model has no such config (the spec check then asks for one)."""
    with meta_init():  # only to read its config: no memory, no weights
        probe = model_fn()
    if not getattr(getattr(probe, "config", None), "base_model_tp_plan", None):
        return None
    plan = hf_tp_plan(probe)
    if say:
        get_logger().info(
            "no --tp-plan given: using the TP plan %s's config carries (base_model_tp_plan, %d patterns)",
            type(probe).__name__,
            len(plan),
        )
    return plan


def config_ep_plan(model_fn, say: bool, *, tp: bool = False) -> dict | None:
    """The experts plan a Hugging Face MoE's config carries (``base_model_ep_plan``; with ``tp``, the
    ``moe_tp_experts`` modules of its TP plan), rooted at the model; None when it has none (the spec check
    then says there are no experts to split, or none is needed)."""
    with meta_init():
        probe = model_fn()
    prefix = getattr(probe, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and getattr(probe, prefix, None) is not None else ""
    plan = hf_experts_plan(probe) if tp else hf_ep_plan(getattr(probe, "config", None), prefix)
    if plan and say:
        get_logger().info(
            "no --ep-plan given: using the experts plan %s's config carries (base_model_ep_plan: %s)",
            type(probe).__name__,
            ", ".join(plan),
        )
    return plan or None


def main(argv: Sequence[str] | None = None) -> int:
    flags = COMMAND_LINE.parse(argv)  # the flags, parsed once
    check, par = flags["check"], flags["parallel"]
    info = dist.setup(seed=check.seed)
    if check.model not in BUILTIN and ":" not in check.model:
        raise UsageError(f"--model {check.model!r}: use one of {', '.join(BUILTIN)}, or module:NAME")
    problems = par.problems(info.world_size)
    dims = par.dims(info.world_size)
    if dims is not None and dims.pp == 1 and check.batch_size % dims.dp == 0:  # gradient accumulation's parts
        problems += accumulation_problems(par.microbatches, check.batch_size // dims.dp, spell=FLAGS)
    if problems:
        raise UsageError("; ".join(problems))
    mesh = init_mesh(**par.degrees, log_coordinates=False)
    model_fn, options, batch_fn, loss_fn = target(check, par, info.world_size)
    if par.tp > 1 and not options.get("tp_plan"):
        options["tp_plan"] = config_tp_plan(model_fn, info.is_main)
    if (par.ep > 1 or par.tp > 1) and not options.get("ep_plan"):  # experts: split over ep, their width over tp
        options["ep_plan"] = config_ep_plan(model_fn, info.is_main, tp=par.tp > 1)
    missing = [
        plan_missing(check.model, axis, n, what, example)
        for axis, n, what, example in (
            ("tp", par.tp, "a TP", "a dict of module-name patterns -> styles, {'blocks.*.q': 'colwise', ...}"),
            ("ep", par.ep, "an experts", "a dict naming the experts modules, {'blocks.*.moe.experts': 'experts'}"),
        )
        if n > 1 and not options.get(f"{axis}_plan")
    ]
    if missing:
        raise UsageError("; ".join(missing))
    spec = ParallelSpec(blocks=check.blocks, ac=par.ac, dp=par.strategy, **options)
    try:
        verdict = verify(
            model_fn,
            mesh,
            spec,
            batch_fn=batch_fn,
            loss_fn=loss_fn,
            steps=check.steps,
            lr=check.lr,
            seed=check.seed,
            rtol=check.rtol,
            microbatches=par.microbatches,
            pp_schedule=par.pipeline_schedule,
            stages_per_rank=par.stages_per_rank,
            cp_attention=par.cp_attention,
            device=info.device,
            spell=VERIFY_FLAGS,
        )
    except UsageError as e:
        if not str(e).startswith(CANNOT_TAKE) or check.model in BUILTIN:
            raise
        raise UsageError(f"{e} (--vocab-size {check.vocab_size}, --seq-len {check.seq_len})") from None
    if info.is_main:
        get_logger().info(
            "verify %s on %d ranks against one process:\n%s", check.model, info.world_size, verdict.table()
        )
    if not verdict.passed:
        raise RunError(
            f"{verdict.layout} does not match one process: max rel diff loss "
            f"{verdict.diffs['loss']:.1e}, grad norm {verdict.diffs['grad_norm']:.1e} > {check.rtol:g}"
        )
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog="python -m mmm.verify")
