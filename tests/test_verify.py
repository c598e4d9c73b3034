"""python -m mmm.verify: a user's model and layout checked against one process (loss and grad norm)."""

import os

import pytest

from conftest import SCRIPTS, assert_clean_user_error, clean_env, launch, run
from mmm.verify import Verdict

VERIFY = ["python3", "-m", "mmm.verify"]


def test_verdict_fails_on_a_constant_factor_on_the_gradients():
    v = Verdict([5.0, 4.0], [1.0, 2.0], [5.0, 4.0], [2.0, 4.0], rtol=1e-5, layout="dp=2")
    assert not v.passed and v.diffs == {"loss": 0.0, "grad_norm": 1.0}
    assert v.table().splitlines()[-1].startswith("FAIL: dp=2")


@pytest.mark.parametrize(
    "build, ranks, flags, layout",
    [
        ("build", 2, ["--tp", "2"], "tp=2, dp=fsdp"),
        ("build", 4, ["--pp", "2", "--ac", "selective"], "pp=2 x dp=2, dp=fsdp, ac=selective"),
        ("build_sequential", 4, ["--pp", "2", "--tp", "2"], "pp=2 x tp=2, dp=fsdp"),
        # tokens and positions in one module called with both (a stand-in takes two arguments); blocks that
        # change the width (the pre-step check runs each stage with all its blocks before it refuses)
        ("build_embed", 2, ["--pp", "2"], "pp=2, dp=fsdp"),
    ],
    ids=["tp2", "pp2-dp2-ac", "sequential-blocks-pp2-tp2", "pp2-embed-both"],
)
def test_own_model_passes(build, ranks, flags, layout):
    """A user's model through verify; its blocks in a ModuleList, or in an nn.Sequential (found by
    blocks='auto' and split into pipeline stages as well). Its TP plan alone on 2 ranks (FSDP x TP: the
    equivalence matrix and test_hf), FSDP over a pipeline, and both on the sequential blocks."""
    plan = ["--tp-plan", "own_lm:TP_PLAN"]
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    res = run(launch("-n", str(ranks), *VERIFY, "--model", f"own_lm:{build}", *plan, *flags), env=env, timeout=180)
    assert res.returncode == 0, res.output
    assert f"PASS: {layout} max rel diff" in res.stdout and "grad norm (mesh)" in res.stdout, res.stdout
    assert res.output.count("returned a view tensor") <= 1, res.output  # FSDP2's warning: once, not per rank


def test_a_tolerance_of_zero_fails_with_a_one_line_error():
    res = run(launch("-n", "2", *VERIFY, "--tp", "2", "--steps", "2", "--rtol", "0"), timeout=180)
    assert res.returncode == 1, res.output
    assert "FAIL: tp=2" in res.stdout
    assert "does not match one process" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--model", "nosuch"], "--model 'nosuch': use one of llama, llama-moe, vit, hf-llama, or module:NAME"),
        (["--model", "vit", "--cp", "2"], "cp=2: context parallel splits token sequences (batch, seq)"),
        (["--ep", "2"], "--ep 2: --model llama has no experts to split; use --model llama-moe"),
        (["--model", "own_lm:build", "--ep", "2"], "--ep 2 needs an experts plan: give --ep-plan module:NAME"),
        (
            ["--model", "own_lm:build", "--tp-plan", "own_lm:TP_PLAN", "--cp", "2"],
            "no module of TinyLM has an 'attn_fn' attribute",
        ),
        (["--strategy", "ddp", "--tp", "2"], "--strategy ddp does not compose with tp"),
        # what the model meets in its first step: token ids past its embedding, a tuple for logits, a TP plan
        # that splits a layer and not its partner (every rank one line, not a traceback from inside torch)
        (
            ["--model", "own_lm:build", "--vocab-size", "256"],
            ("the model cannot take the batches: embed (an embedding of 128 rows) is given ids", "--vocab-size 256, "),
        ),
        (["--model", "own_lm:build_tuple"], "the model returned a tuple, not the logits"),
        (
            ["--model", "own_lm:build", "--tp", "2", "--tp-plan", "own_lm:UP_ONLY_PLAN"],
            "with tp=2 a layer got an input of the wrong shape (mat1 and mat2 shapes cannot be multiplied",
        ),
        # a pipeline split in registration order, checked on meta before the first step (every rank alike:
        # test_a_pipeline_split_out_of_forward_order_is_named), or by the stand-ins in the first real step for
        # a model that cannot run on meta (it reads a value): GPT-2's tok(x) + pos(p)
        (["--model", "own_lm:build_headfirst", "--pp", "2"], "stage 1 of HeadFirstLM's pipeline fails on what"),
        (["--model", "own_lm:build_positions_off_meta", "--pp", "2"], "pos runs before the blocks, and on pipeline"),
        # own experts that return a plain empty tensor on a rank their tokens miss: that rank says so, at once
        # (its peers would wait in the all-to-all of backward until MMM_TIMEOUT)
        (
            ["--model", "own_lm:build_plain_moe", "--ep-plan", "own_lm:PLAIN_EP_PLAN", "--ep", "2"],
            "PlainExperts's output on this rank (no tokens for its 2 experts) takes no part in backward",
        ),
    ],
)
def test_bad_input(flags, needle):
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    res = run(launch("--launcher", "local", "-n", "2", *VERIFY, *flags), env=env, timeout=60)
    assert_clean_user_error(res, *((needle,) if isinstance(needle, str) else needle))


@pytest.mark.parametrize(
    "flags, layout",
    [
        (["--model", "llama", "--cp", "2", "--dp-shard", "1"], "cp=2 (ring attention)"),
        (
            ["--model", "llama-moe", "--ep", "2", "--cp", "2", "--dp-shard", "1", "--cp-attention", "ulysses"],
            "cp=2 x ep=2",
        ),
        # DDP with its all-reduce deferred; the forward passes are counted, not taken from the flag
        (["--strategy", "ddp", "--microbatches", "4"], "dp=2, gradient accumulation: 4 forward passes a step"),
    ],
    ids=["ring-cp2", "moe-ulysses-cp2-ep2", "ddp-accumulate4"],
)
def test_context_and_expert_parallel(flags, layout):
    """verify runs context parallel (both kinds: the model's attn_fn hook and shard_positions), expert
    parallel (the model's experts plan) and gradient accumulation against one process."""
    res = run(launch("-n", "2", *VERIFY, *flags), timeout=180)
    assert res.returncode == 0, res.output
    assert f"PASS: {layout}" in res.stdout, res.stdout


@pytest.mark.parametrize(
    "build, needle",
    [
        ("build", None),
        ("build_embed", None),  # tokens and positions in one module, called with both
        ("build_widening", None),  # blocks that change the width: each stage with all its blocks decides
        ("build_headfirst", "stage 1 of HeadFirstLM's pipeline fails on what the stage before it hands on"),
        ("build_positions", "pos runs before the blocks, and on pipeline stage 1 (which does not hold it) the"),
        ("build_positions_last", "pos is registered after the blocks but runs before them (on pipeline stage 0"),
        ("build_positions_off_meta", None),  # cannot run on meta: left to the first real step's stand-ins
    ],
)
def test_a_pipeline_split_out_of_forward_order_is_named(build, needle, monkeypatch):
    """What every rank runs on meta before a pipeline's first step (mmm.parallel.pipeline.split_problem): a
    split that fails where the whole model runs, or hands a stand-in another tensor than its stage's input
    (GPT-2's tok(x) + pos(p): silently wrong where dim = seq), is named; valid splits pass."""
    import torch

    from mmm.parallel.pipeline import meta_copy, split_problem, stage_layer_ranges

    monkeypatch.syspath_prepend(str(SCRIPTS))
    import own_lm

    model = meta_copy(getattr(own_lm, build)())
    tokens = torch.zeros(4, 32, dtype=torch.long)
    said = split_problem(model, tokens, stage_layer_ranges(4, 2, None), blocks="blocks")
    assert (said is None) if needle is None else (needle in said and "\n" not in said), said


def test_an_experts_plan_given_by_flag():
    """--ep with --ep-plan module:NAME on a module:function model (without the flag: one line naming it)."""
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    res = run(
        launch("-n", "2", *VERIFY, "--model", "own_lm:build_moe", "--ep-plan", "own_lm:EP_PLAN", "--ep", "2"),
        env=env,
        timeout=180,
    )
    assert res.returncode == 0, res.output
    assert "PASS: " in res.stdout and "ep=2" in res.stdout, res.stdout


def test_a_hugging_face_model_without_a_tp_plan_uses_its_configs():
    """--model mypkg:build --tp 2 on a transformers model and no --tp-plan: its config's
    base_model_tp_plan is used, and the log says so (it used to say "the spec has no tp_plan")."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")
    env = clean_env(PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    res = run(launch("-n", "2", *VERIFY, "--model", "hf_lm:build", "--tp", "2", "--steps", "3"), env=env, timeout=240)
    assert res.returncode == 0, res.output
    assert "no --tp-plan given: using the TP plan LlamaForCausalLM's config carries" in res.output, res.output
    assert "PASS: " in res.stdout
