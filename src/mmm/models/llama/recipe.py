"""Llama's recipe (:data:`LLAMA`): what ``python -m mmm.examples.fsdp_tp`` trains, its flags and its
checks, shared with the planner (``python -m mmm.plan`` asks :func:`problems` of every layout, so the
two never disagree). A recipe sits in the training layer beside its model (:mod:`mmm.training.recipe`)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from mmm.cli import FLAGS, Flags, flag_problems, nonnegative_float, nonnegative_int, option, positive_int
from mmm.data import DATASETS, data_tokenizer, data_vocab_size, dataset_problems, make_dataset
from mmm.errors import UsageError
from mmm.flops import llama_flops_per_token
from mmm.log import get_logger
from mmm.models.grouped import grouped_mm_available
from mmm.models.llama.context import apply_cp_llama
from mmm.models.llama.estimate import estimate_comm, estimate_memory
from mmm.models.llama.hf import export_hf_llama, llama_config_from_hf, load_hf_llama
from mmm.models.llama.model import Llama, LlamaConfig
from mmm.models.llama.tp import llama_tp_plan, tp_problems
from mmm.parallel.compose import ParallelSpec
from mmm.parallel.context import cp_problems
from mmm.parallel.experts import balance_experts, ep_problems, routers
from mmm.parallel.hf_checkpoint import export_problems
from mmm.parallel.loss import cross_entropy
from mmm.parallel.pipeline import pipeline_problems
from mmm.parallel.strategy import Engine
from mmm.training.config import Config
from mmm.training.evaluation import EvalConfig
from mmm.training.recipe import Context, Loop, Recipe, Shape
from mmm.training.schedule import ScheduleConfig
from mmm.training.startup import batch_problems
from mmm.training.tokens import held_out_batches, held_out_loss, step_batches

EXAMPLE = "fsdp_tp"
DEFAULT_VOCAB = 256  # bytes: the vocabulary when neither --vocab-size nor the data gives one
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_hidden", "moe_shared", "moe_aux", "moe_bias_rate")  # as LlamaConfig's
MEASURE_STEP = 2  # --measure watches this step (a warmup step with the default --warmup 2)


@dataclass
class LlamaTrainConfig(EvalConfig, ScheduleConfig):
    """What to train: a Llama-style model's shape (or a Hugging Face checkpoint's), the data, the
    global batch and steps, AdamW and its learning-rate schedule, held-out evaluation."""

    dim: int = option(256, "--dim", parse=positive_int, group="model", help="model width")
    n_layers: int = option(4, "--n-layers", "--n_layers", parse=positive_int, group="model", help="transformer blocks")
    n_heads: int = option(8, "--n-heads", parse=positive_int, group="model", help="attention heads (divisible by tp)")
    n_kv_heads: int | None = option(
        None,
        "--n-kv-heads",
        parse=positive_int,
        shown="= n-heads",
        group="model",
        help="key/value heads for grouped-query attention",
    )
    vocab_size: int | None = option(
        None,
        "--vocab-size",
        parse=positive_int,
        shown="the data's (meta.json, --tokenizer), else 256",
        group="model",
        help="vocabulary; at least the data's",
    )
    seq_len: int = option(128, "--seq-len", parse=positive_int, group="model", help="tokens per sequence")
    moe_experts: int = option(
        0,
        "--moe-experts",
        parse=nonnegative_int,
        group="model",
        help="a mixture of experts: routed experts per block in place of the dense feed-forward (0: dense); "
        "token-choice top-k routing, nothing dropped, balanced by DeepSeek-V3's bias (see --moe-bias-rate); "
        "split over --ep ranks",
    )
    moe_top_k: int = option(2, "--moe-top-k", parse=positive_int, group="model", help="experts per token")
    moe_hidden: int | None = option(
        None,
        "--moe-hidden",
        parse=positive_int,
        shown="the dense width / top-k, rounded to a multiple of 32",
        group="model",
        help="each expert's SwiGLU width",
    )
    moe_shared: int = option(
        0, "--moe-shared", parse=nonnegative_int, group="model", help="shared experts every token goes through"
    )
    moe_aux: float = option(
        0.0,
        "--moe-aux",
        parse=nonnegative_float,
        metavar="W",
        group="model",
        help="weight of the sequence-wise load-balancing loss (DeepSeek-V3: 1e-4); 0: none",
    )
    moe_bias_rate: float = option(
        1e-3,
        "--moe-bias-rate",
        parse=nonnegative_float,
        metavar="RATE",
        group="model",
        help="after each step every expert's routing bias moves by this towards balance, from the token counts "
        "of the whole global batch (auxiliary-loss-free balancing); 0: off",
    )
    init_from: str | None = option(
        None,
        "--init-from",
        metavar="DIR",
        group="model",
        help="start from a Hugging Face Llama checkpoint (config.json + *.safetensors, e.g. from save_pretrained): "
        "the model's shape comes from its config.json, and each rank reads only its own shards of the weights",
    )
    export_hf: str | None = option(
        None,
        "--export-hf",
        metavar="DIR",
        group="model",
        help="after the last step write the weights as a Hugging Face Llama checkpoint (config.json + "
        "model.safetensors, and the data's tokenizer.json), loadable with transformers' "
        "LlamaForCausalLM.from_pretrained or --init-from",
    )
    batch_size: int = option(
        16,
        "--batch-size",
        "--batch_size",
        parse=positive_int,
        group="training",
        help="GLOBAL batch in sequences per step, divisible by dp",
    )
    max_iters: int = option(
        40, "--max-iters", "--max_iters", parse=positive_int, group="training", help="optimizer steps"
    )
    weight_decay: float = option(
        0.0, "--weight-decay", parse=nonnegative_float, group="training", help="AdamW weight decay"
    )
    grad_clip: float = option(
        0.0,
        "--grad-clip",
        parse=nonnegative_float,
        group="training",
        help="clip the global gradient L2 norm (over all shards and pipeline stages); 0 = off",
    )
    dataset: str = option(
        "synthetic",
        "--dataset",
        choices=DATASETS,
        group="training",
        help="synthetic (learnable sequences), pydoc (byte-level English text shipped with Python), bin (token "
        "files DIR/train.bin, nanoGPT's format) or hf (a Hugging Face dataset saved with save_to_disk)",
    )
    data_dir: str | None = option(
        None,
        "--data-dir",
        metavar="DIR",
        group="training",
        help="--dataset bin: the directory of train.bin / val.bin (uint16; uint32 as meta.json or the name "
        "train.uint32.bin says; python -m mmm.data prepare writes one); --dataset hf: the save_to_disk directory",
    )
    text_column: str | None = option(
        None,
        "--text-column",
        metavar="NAME",
        shown="input_ids if there is one, else text",
        group="training",
        help="--dataset hf: the column to train on: text (tokenised at load) or lists of token ids",
    )
    tokenizer: str | None = option(
        None,
        "--tokenizer",
        metavar="PATH|bytes",
        shown="bytes",
        group="training",
        help="--dataset hf: a tokenizers tokenizer.json for the text column (its vocabulary sizes the model), or bytes",
    )
    measure: bool = option(
        False,
        "--measure",
        group="training",
        help=f"on step {MEASURE_STEP} (a warmup step; a resumed run: its own second step) count the bytes each mesh "
        "process group communicates and "
        "the bytes of activations saved for backward, per rank, into summary.json (measured_per_rank); that "
        "step runs slower",
    )

    pick_layout: str | None = option(
        None,
        "--pick-layout",
        metavar="HARDWARE",
        group="mesh",
        help="take the planner's layout for this job's world: rank 0 simulates every fsdp/hsdp layout "
        "(python -m mmm.plan.simulate --pick) and predicts its step on HARDWARE (h100, h200, a100, pvc, mi250x, or "
        "a JSON file such as python -m mmm.plan.calibrate writes); mesh flags and --strategy given hold; "
        "the pick and its reasons go to the log and summary.json",
    )

    MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", *MOE_FIELDS)  # --init-from's

    def model_config(self):
        """The model's shape: these fields (the vocabulary: ``vocab_size``, else the data's, else 256),
        or ``init_from``'s config.json."""
        if self.init_from:
            return llama_config_from_hf(self.init_from, seq_len=self.seq_len)
        vocab = self.vocab_size
        if vocab is None:
            vocab = data_vocab_size(self.dataset, data_dir=self.data_dir, tokenizer=self.tokenizer)[0] or DEFAULT_VOCAB
        return LlamaConfig(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=vocab,
            seq_len=self.seq_len,
            **{name: getattr(self, name) for name in MOE_FIELDS},
        )

    def data_options(self) -> dict:
        """Where --dataset bin / hf read from (for mmm.data.make_dataset)."""
        return {"data_dir": self.data_dir, "text_column": self.text_column, "tokenizer": self.tokenizer}

    def problems(self, *, strategy: str = "fsdp") -> list[str]:
        """Problems of these settings alone (and with the data-parallel ``strategy``); those that need the
        mesh and the model's shape are :func:`problems`'."""
        out = flag_problems(self)
        if self.init_from:
            defaults = {f.name: f.default for f in fields(self)}
            changed = [f"--{k.replace('_', '-')}" for k in self.MODEL_FIELDS if getattr(self, k) != defaults[k]]
            if changed:
                out.append(
                    f"{', '.join(changed)}: with --init-from the model's shape comes from "
                    f"{self.init_from}/config.json; drop them"
                )
            if strategy.startswith("zero"):
                out.append(
                    f"--init-from loads into the torch-sharded model; --strategy {strategy} hands "
                    "the model to DeepSpeed first: use --strategy fsdp, hsdp or ddp"
                )
        if self.export_hf and self.moe_experts:
            out.append(
                "--export-hf writes a dense Hugging Face Llama; a mixture of experts (--moe-experts) has no such "
                "checkpoint yet: drop --export-hf (mmm's own checkpoints hold it)"
            )
        if self.export_hf and strategy.startswith("zero"):
            out.append(
                f"--export-hf gathers the torch-sharded model; --strategy {strategy} hands the model to "
                "DeepSpeed: use --strategy fsdp, hsdp or ddp"
            )
        if self.grad_clip < 0:
            out.append(f"--grad-clip {self.grad_clip} must be >= 0 (0 turns clipping off)")
        out += self.schedule_problems(total_steps=self.max_iters)
        out += self.eval_problems()
        if self.measure and self.max_iters < MEASURE_STEP:
            out.append(
                f"--measure watches step {MEASURE_STEP}; --max-iters {self.max_iters} is too few "
                f"(use --max-iters {MEASURE_STEP} or more)"
            )
        return out


def problems(config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
    """Every problem with this configuration on ``world_size`` ranks, at once (the planner asks this
    of each layout): those of the settings alone, then the layout's."""
    return layout_free_problems(config, world_size) + layout_problems(config, world_size)


def layout_problems(config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
    """The layout's problems: its degrees and strategy (and what needs no pipeline or FSDP), and how the
    model, the batch and the sequence split over them. What ``--pick-layout`` checks of its pick."""
    train, par = config.train, config.parallel
    out = par.problems(world_size, experts=train.moe_experts)  # degrees, strategy, compile, without a pipeline/FSDP
    dims = par.dims(world_size)
    try:
        cfg = train.model_config()
    except UsageError:  # the model's own problem: layout_free_problems says it
        return out
    if dims is None:
        return out
    out += cp_problems(
        cp=dims.cp, seq_len=cfg.seq_len, tp=dims.tp, kind=par.cp_attention, n_heads=cfg.n_heads, spell=FLAGS
    )
    if train.batch_size % dims.dp == 0:
        out += pipeline_problems(
            pp=dims.pp,
            n_layers=cfg.n_layers,
            schedule=par.pipeline_schedule,
            stages_per_rank=par.stages_per_rank,
            microbatches=par.microbatches or dims.pp,
            local_batch=train.batch_size // dims.dp,
            split_points=par.split_points,
            spell=FLAGS,
        )
    if cfg.moe and dims.tp > 1:
        for name, width in (
            ("--moe-hidden", cfg.expert_hidden),
            ("the shared experts' width", cfg.moe_shared * cfg.expert_hidden),
        ):
            if width % dims.tp:
                out.append(
                    f"{name} {width} is not divisible by --tp {dims.tp}: the experts' width is split over TP ranks"
                )
    if dims.ep > 1 and not cfg.moe:
        out.append(
            f"--ep {dims.ep} splits a mixture of experts' experts; add --moe-experts N (a multiple of {dims.ep})"
        )
    if cfg.moe:
        out += ep_problems(ep=dims.ep, num_experts=cfg.moe_experts, room=dims.dp_shard * dims.cp, spell=FLAGS)
    if cfg.moe and par.strategy.startswith("zero"):  # (ep > 1 without fsdp: the library's ep check says so)
        out.append(
            f"--moe-experts with --strategy {par.strategy} is not supported yet (DeepSpeed's engine and checkpoints "
            "are not verified with experts); use --strategy fsdp, hsdp or ddp"
        )
    out += tp_problems(
        tp=dims.tp,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        spell=FLAGS,
        world=world_size,
    )
    return out + batch_problems(train.batch_size, dims.dp, microbatches=par.microbatches if dims.pp == 1 else None)


def layout_free_problems(config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
    """The problems of :func:`problems` that do not depend on the mesh (for a run whose layout is still
    to be picked, ``--pick-layout``; the layout's own are checked once it is)."""
    train = config.train
    out = train.problems(strategy=config.parallel.strategy)
    try:
        cfg = train.model_config()
    except UsageError as err:
        return out + [str(err)]
    out += cfg.problems()
    out += dataset_problems(train.dataset, vocab_size=cfg.vocab_size, **train.data_options())
    if train.export_hf:  # checked before training: the export is written after the last step
        run = config.run
        outdir = run.outdir or Path("outputs") / LLAMA.name / "<UTC time>"  # resolve_outdir's default
        keep = {"this run's --outdir": outdir, "this run's --checkpoint-dir": run.checkpoint_dir}
        out += export_problems(f"--export-hf {train.export_hf!r}", train.export_hf, keep=keep)
    return out + config.run.problems(strategy=config.parallel.strategy)


def parallel_spec(how, cfg: LlamaConfig | None = None) -> ParallelSpec:
    """How the trainer parallelises its Llama (``how``: the ParallelConfig): TP + SP with loss parallel,
    each block a unit of activation checkpointing, compile and FSDP, a mixture of experts' experts split
    over ep; the strategy is build_engine's."""
    moe = cfg is not None and cfg.moe
    return ParallelSpec(
        tp_plan=llama_tp_plan(moe=moe, shared=moe and cfg.moe_shared > 0),
        ep_plan={"layers.*.moe.experts": "experts"} if moe else None,
        loss_parallel=True,
        blocks="layers",
        ac=how.ac,
        compile=how.compile,
        float8=how.float8,
        dtype=how.dtype,
        reshard_after_forward=how.reshard,
    )


def loss_fn(logits, labels):
    """The trainer's loss: cross-entropy over every token, in fp32 (no fp32 copy of the logits: see
    :mod:`mmm.parallel.loss`)."""
    return cross_entropy(logits, labels)


def export_hf(train: LlamaTrainConfig, engine, cfg, info, run, log) -> None:
    """--export-hf DIR after the last step (not after a SIGTERM stop): every rank takes part in the
    gather, rank 0 writes; the data's tokenizer.json goes along when there is one."""
    if not train.export_hf:
        return
    if run.stopped_by is not None:
        if info.is_main:
            log.info("--export-hf skipped: the run stopped early (%s); resume it to the last step", run.stopped_by)
        return

    pp_group = engine.pipeline.pp_group if engine.pipeline is not None else None
    if train.tokenizer not in (None, "bytes"):
        tokenizer = Path(train.tokenizer)
    else:  # the one prepare wrote with the tokens (not one an earlier prepare left beside a bytes dataset)
        tokenizer = data_tokenizer(train.dataset, train.data_dir)
    # read first: the folder it lives in may be the export's, whose old contents are moved aside
    tokenizer_bytes = tokenizer.read_bytes() if info.is_main and tokenizer is not None and tokenizer.is_file() else None
    files = {"tokenizer.json": tokenizer_bytes} if tokenizer_bytes is not None else None
    export_hf_llama(engine.unwrapped(), train.export_hf, cfg, pp_group=pp_group, files=files)
    if info.is_main:
        log.info(
            "Hugging Face checkpoint written to %s (config.json, model.safetensors%s)",
            train.export_hf,
            ", tokenizer.json" if files else "",
        )


def expert_balance(engine, mesh):
    """A mixture of experts' step after the update: its routers' counts over the global batch move their
    balancing bias; the step records the load (min/max over the mean) and the auxiliary loss."""
    modules = routers(engine.unwrapped())
    data_group = mesh.group("dp_cp")
    pp_group = engine.pipeline.pp_group if engine.pipeline is not None else None

    def after_update(step):
        return balance_experts(modules, data_group=data_group, pp_group=pp_group)

    return after_update


def experts_summary(cfg: LlamaConfig, mesh, rows: list[dict], device: torch.device) -> dict:
    """summary.json's ``experts``: the mixture's shape, its expert parallel, how its matmuls ran, and the
    last step's load."""
    last = rows[-1] if rows else {}
    return {
        "experts": cfg.moe_experts,
        "top_k": cfg.moe_top_k,
        "shared": cfg.moe_shared,
        "expert_hidden": cfg.expert_hidden,
        "active_params": cfg.num_params(active=True),
        "ep": mesh.ep,
        "experts_per_rank": cfg.moe_experts // mesh.ep,
        "matmuls": "grouped" if grouped_mm_available(torch.empty(0, device=device)) else "loop",
        **{k: last[k] for k in ("moe_load_min", "moe_load_max", "moe_aux", "moe_margin") if k in last},
    }


class LlamaRecipe(Recipe):
    """mmm's Llama on token data: TP + SP with loss parallel, context parallel by ring attention,
    pipelines, ``--init-from`` / ``--export-hf`` Hugging Face checkpoints, ``--pick-layout``."""

    name = EXAMPLE
    config = LlamaTrainConfig
    run_only = frozenset({"export_hf", "init_from", "measure", "weight_decay"})
    titles = {"model": "model (Llama-style)"}
    rate = "tps"

    def problems(self, config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
        return problems(config, world_size)

    def picks_layout(self, config: Config[LlamaTrainConfig]) -> bool:
        return bool(config.train.pick_layout)

    def layout_free_problems(self, config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
        return layout_free_problems(config, world_size)

    def layout_problems(self, config: Config[LlamaTrainConfig], world_size: int) -> list[str]:
        return layout_problems(config, world_size)

    def build(self, model_config: LlamaConfig) -> Llama:
        return Llama(model_config)

    def param_count(self, model_config: LlamaConfig) -> int:
        return model_config.num_params()

    def spec(self, how, model_config) -> ParallelSpec:
        return parallel_spec(how, model_config)

    def loss(self, outputs, targets):
        return loss_fn(outputs, targets)

    def flops_per_unit(self, model_config: LlamaConfig) -> float:
        return llama_flops_per_token(model_config)

    def per_step(self, train: LlamaTrainConfig, model_config: LlamaConfig) -> int:
        return train.batch_size * model_config.seq_len  # tokens

    def example_batch(self, model_config: LlamaConfig, *, rows: int, cp: int = 1):
        tokens = torch.zeros(rows, model_config.seq_len // cp, dtype=torch.long)
        return tokens, tokens

    def shape(self, model_config: LlamaConfig) -> Shape:
        c = model_config
        return Shape(blocks=c.n_layers, seq_len=c.seq_len, heads=c.n_heads, kv_heads=c.n_kv_heads, head_dim=c.head_dim)

    def with_blocks(self, model_config: LlamaConfig, blocks: int) -> LlamaConfig:
        return replace(model_config, n_layers=blocks)

    def experts(self, model_config: LlamaConfig) -> int:
        return model_config.moe_experts

    def estimate(self, config: Config[LlamaTrainConfig], world: int):
        if self.not_estimated(config):  # the simulator has these
            return None
        return estimate_memory(config, world), estimate_comm(config, world)

    def not_estimated(self, config: Config[LlamaTrainConfig]) -> str | None:
        how = config.parallel
        gaps = [
            flag
            for flag, given in (
                ("--moe-experts (routed experts)", config.train.moe_experts),
                ("--cp-attention ulysses", how.cp_attention == "ulysses"),
                ("--ac selective", how.ac == "selective"),
                ("--offload-optimizer", how.offload_optimizer),
            )
            if given
        ]
        return ", ".join(gaps) or None

    def optimizer_args(self, train: LlamaTrainConfig) -> dict:
        return {"lr": train.lr, "weight_decay": train.weight_decay}

    def max_grad_norm(self, train: LlamaTrainConfig) -> float:
        return train.grad_clip

    def measure_step(self, config: Config[LlamaTrainConfig]) -> int | None:
        return MEASURE_STEP if config.train.measure else None

    def prepare(self, model: Llama, mesh, model_config: LlamaConfig, how) -> None:
        if mesh.ep_enabled:
            efsdp = mesh.dims.efsdp
            get_logger().info(
                "expert parallel: %d experts per block over %d ranks (%d each, tokens by all-to-all), %s",
                model_config.moe_experts,
                mesh.ep,
                model_config.moe_experts // mesh.ep,
                f"FSDP over the other {efsdp} ranks of dp_shard x cp"
                if efsdp > 1
                else "not sharded further (ep takes every rank of dp_shard x cp)",
            )
        if mesh.cp_enabled:  # context parallel: ring or all-to-all attention over the cp ranks
            kind = how.cp_attention
            apply_cp_llama(model, mesh["cp"], seq_len=model_config.seq_len, kind=kind)
            get_logger().info(  # rank 0's logger (the others log errors only)
                "context parallel: %s attention over %d ranks, %d tokens each (chunks r and 2cp-1-r of %d)",
                "ring" if kind == "ring" else "all-to-all (Ulysses)",
                mesh.cp,
                model_config.seq_len // mesh.cp,
                2 * mesh.cp,
            )

    def loaded(self, engine: Engine, config: Config[LlamaTrainConfig], log) -> None:
        if config.train.init_from:  # each rank reads only its shards from the safetensors files
            load_hf_llama(engine.unwrapped(), config.train.init_from)
            log.info("weights loaded from %s", config.train.init_from)

    def loop(self, ctx: Context) -> Loop:
        config, cfg, mesh, engine = ctx.config, ctx.model_config, ctx.mesh, ctx.engine
        what = config.train
        data = {"vocab_size": cfg.vocab_size, "seq_len": cfg.seq_len, **what.data_options()}
        dataset = make_dataset(what.dataset, **data)
        rows = {"seed": config.run.seed, "global_batch": what.batch_size, "mesh": mesh, "device": ctx.device}
        batch = step_batches(dataset, **rows)  # this rank's rows (its sequence shard under cp)
        heldout = []  # the data's val split: the same --eval-iters global batches at every evaluation
        if what.eval_every:
            heldout = held_out_batches(make_dataset(what.dataset, split="val", **data), count=what.eval_batches, **rows)

        def held_out(step, last):  # the held-out loss every --eval-every steps (left out of the step's dt)
            due = what.eval_due(step, last=last)
            return held_out_loss(engine, heldout, loss_fn, sync=ctx.run.sync) if due else {}

        def finish():  # --export-hf DIR: a Hugging Face checkpoint
            export_hf(what, engine, cfg, ctx.info, ctx.run, ctx.log)
            out = {"dataset": dataset.name, "tokens_per_step": what.batch_size * cfg.seq_len}
            if cfg.moe:
                out["experts"] = experts_summary(cfg, mesh, ctx.run.hist.rows, ctx.info.device)
            return out

        schedule = what.schedule(total_steps=what.max_iters)  # the step's learning rate: warmup, decay
        return Loop(
            last_step=what.max_iters,
            lr_at=schedule,
            batch=batch,
            after_update=expert_balance(engine, mesh) if cfg.moe else None,
            evaluate=held_out,
            meta={"dataset": what.dataset, "lr_schedule": schedule.as_dict()},
            finish=finish,
        )


LLAMA = LlamaRecipe()


def command_line(doc: str = "") -> Flags:
    """The trainer's flags (``doc``: its --help text); ``command_line(doc).parse(argv)`` is its Config."""
    return LLAMA.command_line(doc)


make_engine = LLAMA.make_engine  # the trainer's engine for a model on meta (the planner's simulated ranks too)
