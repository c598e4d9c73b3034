"""Any Hugging Face ``transformers`` causal LM as a recipe (:data:`HF_CAUSAL_LM`): the model built on
meta from its ``config.json`` alone (random weights, nothing downloaded), sharded by the TP plan its
config carries (``base_model_tp_plan``), trained on token data by the one trainer and simulated by
the planner like mmm's own models::

    python -m mmm.plan.simulate --recipe hf --hf-config ~/models/Qwen2-7B/config.json --world 64 --tp 2
    launch -n 4 python3 -m mmm.training.trainer --recipe hf --hf-config ./config.json --tp 2

Needs ``pip install 'mmm[hf]'`` (transformers), imported only when this recipe is used. Context
parallel is refused (the attention is transformers' own); the plan's styles must be ``colwise`` or
``rowwise`` (mmm maps those).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from mmm.cli import FLAGS, flag_problems, option, positive_int
from mmm.data import DATASETS, dataset_problems, make_dataset
from mmm.errors import Spelling, UsageError, first_line
from mmm.log import quiet_torchao
from mmm.parallel.compose import ParallelSpec, find_blocks, get_submodule
from mmm.parallel.experts import count_expert_tokens, ep_degrees, expert_load, hf_ep_plan
from mmm.parallel.loss import cross_entropy
from mmm.parallel.meta import meta_init
from mmm.parallel.pipeline import pipeline_problems
from mmm.parallel.tensor import HF_STYLES, hf_experts_plan, hf_tp_plan
from mmm.training.config import Config
from mmm.training.evaluation import EvalConfig
from mmm.training.recipe import Context, Loop, Recipe, Shape
from mmm.training.schedule import ScheduleConfig
from mmm.training.startup import batch_problems
from mmm.training.tokens import held_out_batches, held_out_loss, step_batches


@dataclass
class HFTrainConfig(EvalConfig, ScheduleConfig):
    """What to train: a transformers causal LM of a config.json, the data, the global batch and steps."""

    hf_config: str | None = option(
        None,
        "--hf-config",
        metavar="PATH",
        group="model",
        help="the model's config.json (or a folder holding one): any transformers causal LM, built on meta "
        "with random weights (no weights are read)",
    )
    seq_len: int = option(128, "--seq-len", parse=positive_int, group="model", help="tokens per sequence")
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
    dataset: str = option(
        "synthetic",
        "--dataset",
        choices=tuple(d for d in DATASETS if d in ("synthetic", "bin")),
        group="training",
        help="synthetic (learnable sequences) or bin (token files DIR/train.bin of the model's vocabulary)",
    )
    data_dir: str | None = option(
        None, "--data-dir", metavar="DIR", group="training", help="--dataset bin: the directory of train.bin / val.bin"
    )

    def problems(self) -> list[str]:
        out = flag_problems(self) + self.schedule_problems(total_steps=self.max_iters) + self.eval_problems()
        if not self.hf_config:
            out.append("--hf-config PATH is needed: the model's config.json (or the folder holding it)")
        return out


def _config_file(path: str) -> Path:
    p = Path(path).expanduser()
    return p / "config.json" if p.is_dir() else p


@cache
def load_hf_config(path: str):
    """The transformers config of ``path`` (a config.json, or a folder with one), for training: no KV cache."""
    file = _config_file(path)
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"--hf-config {path!r}: no such file (give a config.json or the folder holding it)") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--hf-config {path!r}: cannot read {file} as JSON ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise UsageError(f"--hf-config {path!r}: {file} has no model_type; is it a transformers config.json?")
    quiet_torchao()
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError("--recipe hf needs transformers: pip install 'mmm[hf]'") from None
    kind = raw.pop("model_type")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"--hf-config {path!r}: model_type {kind!r} has no causal LM in transformers "
            "(AutoModelForCausalLM); the hf recipe trains causal language models"
        )
    try:  # transformers' configs validate their fields with it (huggingface_hub 1.0 on)
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError  # noqa: N806  (already caught: an older hub has no such check)

    try:
        config = AutoConfig.for_model(kind, **raw)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:  # a field of the wrong type or value
        why = " ".join(str(e).split())  # its validator's lines, as one
        raise UsageError(f"--hf-config {path!r}: transformers refuses it ({why})") from None
    config.use_cache = False
    return config


# the trainer's flags, and the model's block count as its config names it (it has no --n-layers)
HF_FLAGS = Spelling(flags={**FLAGS.flags, "n_layers": "--hf-config's num_hidden_layers"})


@dataclass(frozen=True)
class HFModel:
    """The model a run trains: the transformers ``config`` and the sequences' length."""

    config: object
    seq_len: int


def _causal_lm(config):
    quiet_torchao()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


@cache
def _meta_causal_lm(config_json: str):
    """The causal LM of this config built on meta (no memory), once per config: its blocks and its
    parameter count are read from the same build."""
    quiet_torchao()
    from transformers import AutoConfig

    raw = json.loads(config_json)
    with torch.device("meta"):
        return _causal_lm(AutoConfig.for_model(raw.pop("model_type"), **raw))


@cache
def _blocks(config_json: str) -> str:
    """Where the causal LM of this config keeps its repeated blocks: ``model.layers`` (Llama, Mistral, Qwen,
    ...), else the largest list of same-typed modules (GPT-2's ``transformer.h``), found on meta."""
    model = _meta_causal_lm(config_json)
    layers = get_submodule(model, "model.layers")
    return "model.layers" if isinstance(layers, torch.nn.ModuleList) else find_blocks(model, "auto") or "model.layers"


@cache
def _params_outside_embedding(config_json: str) -> int:
    """Parameters of the causal LM of this config outside its input embedding (built on meta: no memory)."""
    model = _meta_causal_lm(config_json)
    return sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()


class HFCausalLMRecipe(Recipe):
    """A transformers causal LM from its config.json, on token data."""

    name = "hf"
    config = HFTrainConfig
    titles = {"model": "model (a transformers causal LM)"}
    rate = "tps"
    parallel_flags = (
        "tp",
        "pp",
        "dp_replicate",
        "dp_shard",
        "strategy",
        "dtype",
        "compile",
        "float8",
        "ac",
        "reshard_after_forward",
        "ep",
        "microbatches",
        "pp_schedule",
        "stages_per_rank",
        "split_points",
    )

    def not_offered(self, field: str) -> str:
        if field in ("cp", "cp_attention"):
            return (
                "no context parallel for transformers models: their attention is their own (mmm's Llama has it: "
                "python -m mmm.examples.fsdp_tp)"
            )
        return "the hf recipe trains with torch's strategies (fsdp, hsdp, ddp), not DeepSpeed's ZeRO"

    def problems(self, config: Config[HFTrainConfig], world_size: int) -> list[str]:
        train, par = config.train, config.parallel
        out = par.problems(world_size) + train.problems()
        if par.cp != 1:
            out.append(
                f"--cp {par.cp}: a transformers model's attention is its own; context parallel needs mmm's Llama"
            )
        if par.strategy.startswith("zero"):
            out.append(f"--strategy {par.strategy}: the hf recipe trains with torch strategies (fsdp, hsdp, ddp)")
        if not train.hf_config:
            return out
        try:
            cfg = load_hf_config(train.hf_config)
        except UsageError as e:
            return [*out, str(e)]
        except ImportError:
            return [*out, "--recipe hf needs transformers: pip install 'mmm[hf]'"]
        try:  # on meta (no memory), once: the FLOPs count builds it too
            _params_outside_embedding(cfg.to_json_string())
        except (ValueError, TypeError, RuntimeError) as e:  # the config's values (heads, sizes), not mmm's code
            if isinstance(e, RuntimeError) and "negative dimension" not in str(e):
                raise  # not a size from the config: a bug (in mmm, transformers or torch) keeps its traceback
            return [
                *out,
                f"--hf-config {train.hf_config}: transformers cannot build {type(cfg).__name__}'s model from it "
                f"({first_line(e)}); fix that value in its config.json",
            ]
        if getattr(cfg, "output_router_logits", False):
            coef = getattr(cfg, "router_aux_loss_coef", None)
            out.append(
                f"--hf-config {train.hf_config}: output_router_logits is true, which asks transformers for its "
                f"load-balancing loss (router_aux_loss_coef {coef}); the hf recipe's loss is the logits' "
                "cross-entropy and would not add it: set output_router_logits to false in its config.json"
            )
        plan = dict(getattr(cfg, "base_model_tp_plan", None) or {})
        dims = par.dims(world_size)
        if dims is not None and dims.ep > 1:
            experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
            if not hf_ep_plan(cfg):
                out.append(
                    f"--ep {dims.ep}: {type(cfg).__name__} carries no experts plan (base_model_ep_plan with "
                    "ep_dispatch_experts): no experts to split; use --ep 1"
                )
            elif experts and experts % dims.ep:
                room = dims.dp_shard * dims.cp
                out.append(
                    f"--ep {dims.ep} does not divide the model's {experts} experts; use --ep "
                    f"{' or '.join(map(str, ep_degrees(experts, room)[:2]))} (dividing both {experts} and dp_shard x "
                    f"cp = {room})"
                )
        if dims is not None and dims.tp > 1:
            if not plan:
                out.append(f"--tp {dims.tp}: {type(cfg).__name__} carries no TP plan (base_model_tp_plan); use --tp 1")
            unknown = sorted({v for v in plan.values() if v not in HF_STYLES})
            if unknown:
                out.append(
                    f"--tp {dims.tp}: {type(cfg).__name__}'s TP plan uses style(s) {', '.join(unknown)}, which mmm "
                    f"does not map (only {', '.join(HF_STYLES)}); use --tp 1"
                )
            heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
            for what, n in (("attention heads", heads), ("key/value heads", kv)):
                if n % dims.tp:
                    out.append(f"--tp {dims.tp} does not divide the model's {n} {what}; use a divisor of {n}")
        if train.seq_len > getattr(cfg, "max_position_embeddings", train.seq_len):
            out.append(
                f"--seq-len {train.seq_len} is longer than the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        if dims is not None and dims.pp > 1 and (blocks := _blocks(cfg.to_json_string())) != "model.layers":
            out.append(
                f"--pp {dims.pp}: {type(cfg).__name__}'s model keeps its blocks in {blocks}; the hf recipe splits "
                "pipelines of Llama-family models (blocks in model.layers): use --pp 1"
            )
        if dims is not None:
            out += batch_problems(train.batch_size, dims.dp, microbatches=par.microbatches if dims.pp == 1 else None)
            if train.batch_size % dims.dp == 0:
                out += pipeline_problems(
                    pp=dims.pp,
                    n_layers=cfg.num_hidden_layers,
                    schedule=par.pipeline_schedule,
                    stages_per_rank=par.stages_per_rank,
                    microbatches=par.microbatches or dims.pp,
                    local_batch=train.batch_size // dims.dp,
                    split_points=par.split_points,
                    spell=HF_FLAGS,
                )
        out += dataset_problems(train.dataset, vocab_size=cfg.vocab_size, data_dir=train.data_dir)
        return out + config.run.problems(strategy=par.strategy)

    def model_config(self, train: HFTrainConfig) -> HFModel:
        if not train.hf_config:
            raise UsageError("--hf-config PATH is needed: the model's config.json (or the folder holding it)")
        return HFModel(load_hf_config(train.hf_config), train.seq_len)

    def build(self, model_config: HFModel):
        return _causal_lm(model_config.config)

    def describe(self, model_config: HFModel) -> str:
        c = model_config.config
        return (
            f"model: {type(c).__name__} ({c.num_hidden_layers} layers, hidden {c.hidden_size}, vocabulary "
            f"{c.vocab_size}), random weights, sequences of {model_config.seq_len}"
        )

    def summary(self, model_config: HFModel) -> dict:
        c = model_config.config
        shape = {k: v for k, v in c.to_diff_dict().items() if k != "transformers_version"}  # not the model's
        return {"model_type": c.model_type, **shape, "seq_len": model_config.seq_len}

    def spec(self, how, model_config: HFModel) -> ParallelSpec:
        tp_plan, ep_plan = {}, None
        if how.tp != 1:  # the config's plan, mapped and matched against the model (built on meta: no memory)
            with meta_init():
                probe = self.build(model_config)
            tp_plan, ep_plan = hf_tp_plan(probe), hf_experts_plan(probe) or None
        if how.ep != 1:
            ep_plan = hf_ep_plan(model_config.config, "model.")
        return ParallelSpec(
            tp_plan=tp_plan,
            ep_plan=ep_plan,
            blocks=_blocks(model_config.config.to_json_string()),
            ac=how.ac,
            compile=how.compile,
            float8=how.float8,
            dtype=how.dtype,
            reshard_after_forward=how.reshard,
        )

    def experts(self, model_config: HFModel) -> int:
        c = model_config.config
        return (getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0) if hf_ep_plan(c) else 0

    def loss(self, outputs, targets):
        logits = outputs.logits if hasattr(outputs, "logits") else outputs
        return cross_entropy(logits, targets)

    def flops_per_unit(self, model_config: HFModel) -> float:
        """Per token: 6 per parameter outside the input embedding, plus attention's scores and values
        (as :func:`mmm.flops.llama_flops_per_token` counts mmm's Llama)."""
        c = model_config.config
        n = _params_outside_embedding(c.to_json_string())
        return 6.0 * n + 12.0 * c.num_hidden_layers * c.hidden_size * model_config.seq_len

    def per_step(self, train: HFTrainConfig, model_config: HFModel) -> int:
        return train.batch_size * model_config.seq_len  # tokens

    def example_batch(self, model_config: HFModel, *, rows: int, cp: int = 1):
        tokens = torch.zeros(rows, model_config.seq_len // cp, dtype=torch.long)
        return tokens, tokens

    def shape(self, model_config: HFModel) -> Shape:
        c = model_config.config
        heads = c.num_attention_heads
        return Shape(
            blocks=c.num_hidden_layers,
            seq_len=model_config.seq_len,
            heads=heads,
            kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        )

    def with_blocks(self, model_config: HFModel, blocks: int) -> HFModel:
        copy = type(model_config.config).from_dict(model_config.config.to_dict())
        copy.num_hidden_layers = blocks
        kinds = getattr(copy, "layer_types", None)  # per-layer attention kinds (e.g. sliding windows)
        if kinds is not None:
            copy.layer_types = [kinds[min(i, len(kinds) - 1)] for i in range(blocks)]
        copy.use_cache = False
        return HFModel(copy, model_config.seq_len)

    def loop(self, ctx: Context) -> Loop:
        config, cfg, mesh, engine = ctx.config, ctx.model_config.config, ctx.mesh, ctx.engine
        what = config.train
        data = {"vocab_size": cfg.vocab_size, "seq_len": what.seq_len, "data_dir": what.data_dir}
        dataset = make_dataset(what.dataset, **data)
        rows = {"seed": config.run.seed, "global_batch": what.batch_size, "mesh": mesh, "device": ctx.device}
        batch = step_batches(dataset, **rows)  # this rank's rows of each step's global batch
        heldout = []  # the data's val split: the same --eval-iters global batches at every evaluation
        if what.eval_every:
            heldout = held_out_batches(make_dataset(what.dataset, split="val", **data), count=what.eval_batches, **rows)

        def held_out(step, last):
            due = what.eval_due(step, last=last)
            return held_out_loss(engine, heldout, self.loss, sync=ctx.run.sync) if due else {}

        schedule = what.schedule(total_steps=what.max_iters)
        after_update, experts = None, self.experts(ctx.model_config)
        if experts:  # the mixture's expert load, counted where its experts are handed their tokens
            counters, data_group = count_expert_tokens(engine.unwrapped()), mesh.group("dp_cp")

            def after_update(step):
                return expert_load(counters, data_group=data_group, device=ctx.device)

        def finish():
            out = {"dataset": dataset.name, "tokens_per_step": what.batch_size * what.seq_len}
            if experts:
                last = ctx.run.hist.rows[-1] if ctx.run.hist.rows else {}
                out["experts"] = {
                    "experts": experts,
                    "top_k": getattr(cfg, "num_experts_per_tok", None),
                    "ep": mesh.ep,
                    "experts_per_rank": experts // mesh.ep,
                    **{k: last[k] for k in ("moe_load_min", "moe_load_max") if k in last},
                }
            return out

        return Loop(
            last_step=what.max_iters,
            lr_at=schedule,
            batch=batch,
            evaluate=held_out,
            after_update=after_update,
            meta={"dataset": what.dataset, "lr_schedule": schedule.as_dict()},
            finish=finish,
        )


HF_CAUSAL_LM = HFCausalLMRecipe()
