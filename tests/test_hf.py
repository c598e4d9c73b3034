"""A Hugging Face transformers LlamaForCausalLM through mmm's public API (examples/bring_your_own_model.py):
dp2 x tp2 and pp2 x dp2 give one process's per-step loss and global gradient norm."""

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import clean_env, jsonl, launch, max_rel_diff, run
from mmm.errors import UsageError

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")

SCRIPT = str(Path(__file__).parents[1] / "examples" / "bring_your_own_model.py")
RTOL = 1e-5


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def test_the_shipped_plan_is_the_configs_own_and_matches_the_model():
    from mmm.models.hf import HF_LLAMA_TP_PLAN
    from mmm.parallel.tensor import hf_tp_plan, resolve_plan

    model = tiny_llama()
    assert hf_tp_plan(model) == HF_LLAMA_TP_PLAN
    resolved = resolve_plan(model, HF_LLAMA_TP_PLAN)
    assert resolved["model.layers.1.self_attn.o_proj"] == "rowwise" and len(resolved) == 2 * 7


def test_a_pattern_that_matches_nothing_is_an_error():
    from mmm.errors import UsageError
    from mmm.parallel.tensor import resolve_plan

    with pytest.raises(UsageError, match="'layers.\\*.attn.q' match no module of LlamaForCausalLM; its linear") as e:
        resolve_plan(tiny_llama(), {"layers.*.attn.q": "colwise"})  # a plan for other names: the layers it has
    assert "(what a plan splits): 'model.embed_tokens', 'model.layers.*.self_attn.q_proj'," in str(e.value), e.value
    with pytest.raises(UsageError, match="'model.layers.\\*.self_attn.q' match no module of .*; did you mean") as e:
        resolve_plan(tiny_llama(), {"model.layers.*.self_attn.q": "colwise"})  # a near miss: the nearest, as patterns
    assert "'model.layers.*.self_attn.q_proj'?" in str(e.value), str(e.value)


def test_plans_and_context_parallel_on_a_transformers_model_name_the_fix():
    """An experts plan's near miss names the nearest modules (as a TP plan's does); context parallel on a
    transformers model says it has none (its attention is transformers' own), not "give it a hook"."""
    from mmm.parallel.context import context_parallel
    from mmm.parallel.experts import expert_modules

    with pytest.raises(UsageError, match="did you mean 'model.layers.\\*.mlp.up_proj'"):
        expert_modules(tiny_llama(), {"model.layers.*.mlp.up_prj": "experts"})
    with pytest.raises(UsageError, match="unknown style 'expert'; the style is 'experts'"):
        expert_modules(tiny_llama(), {"model.layers.*.mlp": "expert"})
    with pytest.raises(UsageError, match="^no context parallel for LlamaForCausalLM: a transformers model's attention"):
        context_parallel(tiny_llama(), None, seq_len=8)


def test_blocks_found_automatically():
    from mmm.parallel.compose import find_blocks

    assert find_blocks(tiny_llama()) == "model.layers"
    with pytest.raises(
        UsageError, match="blocks='layers' names nothing in LlamaForCausalLM; .*which finds 'model.layers'"
    ):
        find_blocks(tiny_llama(), "layers")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf1")
    res = run([sys.executable, SCRIPT, "--outdir", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    return jsonl(out / "history.jsonl", key=None)


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--pp", "2"]], ids=["dp2-tp2", "pp2-dp2"])
def test_hf_llama_layouts_match_one_process(reference, tmp_path, flags):
    res = run(launch("-n", "4", "python3", SCRIPT, *flags, "--outdir", str(tmp_path)), timeout=240)
    assert res.returncode == 0, res.output
    got = jsonl(tmp_path / "history.jsonl", key=None)
    for key in ("loss", "grad_norm"):
        assert max_rel_diff([r[key] for r in got], [r[key] for r in reference]) <= RTOL, key
    assert "Traceback" not in res.stderr and "Warning" not in res.stderr and "redistributing" not in res.stderr


def test_llama_3_1_rope_scaling_loads_and_gives_transformers_logits(tmp_path):
    """A Llama 3.1 config (rope_type "llama3": long wavelengths stretched, short ones kept, the rest
    between; this one has all three) loads into mmm's Llama with transformers' logits, and its export
    writes the scaling back. Without the scaling the logits differ by ~4e-3."""
    from mmm.models.llama import Llama
    from mmm.models.llama.hf import hf_llama_config, llama_config_from_hf, load_hf_llama

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 128}
    torch.manual_seed(0)
    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    import hf_lm  # the tiny transformers Llama of the verify tests, its rotary scaled

    config = hf_lm.build().config
    config.max_position_embeddings, rope = 256, {"rope_type": "llama3", "rope_theta": 1e4, **scaling}
    setattr(config, "rope_parameters" if "rope_parameters" in config.to_dict() else "rope_scaling", rope)  # 5 / 4.x
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    cfg = llama_config_from_hf(tmp_path, seq_len=200)
    assert cfg.rope_scaling == scaling
    mine = Llama(cfg).eval()
    load_hf_llama(mine, tmp_path)
    tokens = torch.randint(0, 256, (2, 200))
    with torch.no_grad():
        want, got = theirs(tokens).logits, mine(tokens)
    assert (want - got).abs().max() <= 1e-5 * want.std(), (want - got).abs().max()
    back = transformers.LlamaConfig(**hf_llama_config(cfg))
    assert {k: back.rope_parameters[k] for k in ("rope_type", *scaling)} == {"rope_type": "llama3", **scaling}
    other = json.loads((tmp_path / "config.json").read_text())
    other["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(UsageError, match="rope_type 'yarn' .*plain rotary embeddings, or Llama 3.1's 'llama3'"):
        llama_config_from_hf(tmp_path)


def test_selective_checkpointing_of_a_model_with_its_kv_cache_on(tmp_path):
    """transformers' configs turn the key/value cache on by default; under activation checkpointing the
    recomputation saw longer keys than the forward ("... not found in storage", in backward). parallelize
    turns the cache off for training, and the layout matches one process."""
    (tmp_path / "cached_lm.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "def build():\n"
        "    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)\n"
        "    assert config.use_cache\n"
        "    return LlamaForCausalLM(config)\n"
    )
    verify = ["-m", "mmm.verify", "--model", "cached_lm:build", "--ac", "selective", "--steps", "2"]
    res = run([sys.executable, *verify], env=clean_env(PYTHONPATH=str(tmp_path)), timeout=180)
    assert res.returncode == 0 and "PASS" in res.output, res.output
    assert "config.use_cache turned off" in res.output


# --------------------------------------------------------------------------- a mixture of experts
HF_TRAINER = ["-m", "mmm.training.trainer", "--recipe", "hf", "--seq-len", "32", "--batch-size", "8"]
HF_TRAINER += ["--max-iters", "4", "--lr", "3e-3", "--seed", "3", "--no-plots"]  # routing far from ties


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE config.json (8 experts, top-2) and its one-process run (random weights)."""
    path = tmp_path_factory.mktemp("qwen3moe")
    transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    ).save_pretrained(path)
    out = path / "single"
    res = run([sys.executable, *HF_TRAINER, "--hf-config", str(path), "--outdir", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    return path, jsonl(out / "history.jsonl", key=None)


@pytest.mark.parametrize(
    "flags",
    [["--ep", "2"], ["--ep", "2", "--pp", "2", "--microbatches", "2"], ["--tp", "2", "--ep", "2"]],
    ids=["dp4-ep2", "pp2-dp2-ep2", "tp2-ep2"],  # dp4-ep2: the experts FSDP-sharded over efsdp 2 as well
)
def test_hf_mixture_of_experts_with_expert_parallel_matches_one_process(qwen3_moe, tmp_path, flags, request):
    """transformers' Qwen3-MoE experts split over ep by its config's own experts plan (base_model_ep_plan):
    their forward sends tokens by all-to-all; with tp its own TP plan too (q_norm/k_norm's
    replicated_with_grad_allreduce, the experts' packed_colwise gate_up_proj); loss and grad norm equal
    one process's, and so does the expert load the run records (counted where each experts module is handed
    its tokens, summed over the data-parallel ranks, the stages' worst combined)."""
    config, reference = qwen3_moe
    cmd = launch("-n", "4", "python3", *HF_TRAINER, "--hf-config", str(config), *flags, "--outdir", str(tmp_path))
    res = run(cmd, timeout=240)
    assert res.returncode == 0, res.output
    got = jsonl(tmp_path / "history.jsonl", key=None)
    for key in ("loss", "grad_norm", "moe_load_min", "moe_load_max"):
        assert max_rel_diff([r[key] for r in got], [r[key] for r in reference]) <= RTOL, key
    assert all(0 <= r["moe_load_min"] <= 1 <= r["moe_load_max"] <= 8 / 2 for r in got), got  # 8 experts, top-2
    assert len({r["moe_load_max"] for r in got}) > 1, got  # counted each step, not once
    experts = json.loads((tmp_path / "summary.json").read_text())["experts"]
    assert experts["experts"] == 8 and experts["top_k"] == 2 and experts["ep"] == 2, experts
    assert experts["moe_load_max"] == got[-1]["moe_load_max"], experts
    # the experts' placement in the sharding table (efsdp of one rank, under pp 2, left out)
    placement = {"dp4-ep2": "  efsdp:_StridedShard(0), ep:Shard(0)\n", "tp2-ep2": "etp:_StridedShard(1)\n"}
    assert placement.get(request.node.callspec.id, "  ep:Shard(0)\n") in res.stdout, res.stdout


def test_hf_mixture_of_experts_through_verify(qwen3_moe, tmp_path):
    """mmm.verify of a transformers MoE with --ep: the experts plan comes from its config, and says so."""
    config, _ = qwen3_moe
    (tmp_path / "qwen_moe_lm.py").write_text(
        "from transformers import AutoConfig, AutoModelForCausalLM\n\ndef build():\n"
        f"    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(config)!r}))\n"
    )
    env = clean_env(PYTHONPATH=str(tmp_path))
    res = run(
        launch("-n", "2", "python3", "-m", "mmm.verify", "--model", "qwen_moe_lm:build", "--ep", "2"),
        env=env,
        timeout=240,
    )
    assert res.returncode == 0, res.output
    assert "no --ep-plan given: using the experts plan Qwen3MoeForCausalLM's config carries" in res.output
    assert "PASS: dp=2 x ep=2" in res.stdout


def test_a_mixture_the_recipe_cannot_train_as_configured_is_refused_naming_the_fix(tmp_path):
    """A config that asks for transformers' own balancing loss (output_router_logits), which the recipe's
    cross-entropy would not add, is refused rather than trained unbalanced; an ep that does not split the
    experts names the degrees that do."""
    from mmm.models.hf.recipe import HF_CAUSAL_LM

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=8)
    shape |= dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    transformers.Qwen3MoeConfig(**shape, num_experts=6, output_router_logits=True).save_pretrained(tmp_path)
    config = HF_CAUSAL_LM.command_line().parse(["--hf-config", str(tmp_path), "--ep", "4", "--batch-size", "8"])
    problems = HF_CAUSAL_LM.problems(config, 4)
    assert any("output_router_logits is true" in p and "set output_router_logits to false" in p for p in problems)
    assert any("--ep 4 does not divide the model's 6 experts; use --ep 2 or 1" in p for p in problems), problems


def test_a_config_transformers_refuses_or_a_layout_it_cannot_split_is_refused_in_one_line(tmp_path):
    """A config.json transformers refuses (a field of the wrong type; heads that do not divide the width; a
    negative size) is one problem naming it, not a traceback from building the model; a model whose blocks
    are not in model.layers (GPT-2's transformer.h) trains with FSDP, its blocks found, and is refused a
    pipeline (named where its blocks are)."""
    from mmm.models.hf.recipe import HF_CAUSAL_LM, _blocks

    llama = dict(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64, vocab_size=100)
    cases = {
        "type": ({**llama, "num_attention_heads": 4, "hidden_size": "big"}, "expected int, got str"),
        "heads": ({**llama, "num_attention_heads": 5}, "not a multiple of the number of attention heads"),
        "negative": ({**llama, "num_attention_heads": 4, "intermediate_size": -4}, "negative dimension"),
    }
    for name, (raw, needle) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(raw))
        try:
            config = HF_CAUSAL_LM.command_line().parse(["--hf-config", str(path)])
            problems = HF_CAUSAL_LM.problems(config, 1)
        except UsageError as e:
            problems = [str(e)]
        assert any(needle in p and str(path) in p and "\n" not in p for p in problems), (name, problems)

    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=100)))
    assert _blocks(transformers.AutoConfig.from_pretrained(gpt2).to_json_string()) == "transformer.h"
    config = HF_CAUSAL_LM.command_line().parse(["--hf-config", str(gpt2), "--pp", "2", "--batch-size", "4"])
    assert any("keeps its blocks in transformer.h" in p and "use --pp 1" in p for p in HF_CAUSAL_LM.problems(config, 2))
    trainer = [sys.executable, "-m", "mmm.training.trainer", "--recipe", "hf", "--hf-config", str(gpt2)]
    res = run([*trainer, "--seq-len", "16", "--batch-size", "4", "--max-iters", "2", "--outdir", str(tmp_path / "o")])
    assert res.returncode == 0, res.output
