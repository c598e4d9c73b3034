"""Recipes: a user's own model through the one trainer, the planner and mmm.verify; any transformers
causal LM from its config.json alone through the simulator (exact per-rank state) and the trainer;
mmm's ViT picked by the planner."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from conftest import ROOT, assert_clean_user_error, clean_env, jsonl, launch, max_rel_diff, run

EXAMPLES = ROOT / "examples"
OWN = [str(EXAMPLES / "own_recipe.py"), "--max-iters", "3", "--no-plots"]
SIMULATE = [sys.executable, "-m", "mmm.plan.simulate"]


def examples_env() -> dict[str, str]:
    return clean_env(PYTHONPATH=os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")]))


def test_a_users_recipe_trains_plans_and_verifies(tmp_path):
    """examples/own_recipe.py: its model, trained by mmm's trainer on dp 1 x tp 2, gives one process's
    losses and gradient norms; the planner simulates and picks a layout for it; mmm.verify passes it."""
    one = run([sys.executable, *OWN, "--outdir", str(tmp_path / "one")], timeout=120)
    assert one.returncode == 0, one.output
    two = run(launch("-n", "2", "python3", *OWN, "--tp", "2", "--outdir", str(tmp_path / "tp2")), timeout=120)
    assert two.returncode == 0, two.output
    for key in ("loss", "grad_norm"):
        assert (
            max_rel_diff(jsonl(tmp_path / "tp2" / "history.jsonl", key), jsonl(tmp_path / "one" / "history.jsonl", key))
            < 1e-5
        )
    summary = json.loads((tmp_path / "tp2" / "summary.json").read_text())
    assert summary["example"] == "own_gpt" and summary["mesh"]["tp"] == 2

    picked = tmp_path / "pick.json"
    sim = [*SIMULATE, "--recipe", "own_recipe:RECIPE", "--world", "8", "--pick", "--hardware", "h100", "--jobs", "1"]
    res = run([*sim, "--json", str(picked)], env=examples_env(), timeout=180)
    assert res.returncode == 0, res.output
    rows = json.loads(picked.read_text())
    assert len(rows) >= 3 and all(r["degrees"]["pp"] == r["degrees"]["cp"] == 1 for r in rows), rows  # its checks
    assert f"pick: {' '.join(rows[0]['flags'])}" in res.stdout

    verify = launch("-n", "2", "python3", "-m", "mmm.verify", "--model", "own_recipe:RECIPE", "--tp", "2")
    res = run(verify, env=examples_env(), timeout=120)
    assert res.returncode == 0 and "PASS: tp=2" in res.stdout, res.output


def _hf_config(path: Path, kind: str) -> Path:
    """A small config.json of a transformers model (written with transformers itself): shapes that split
    unevenly over 32 FSDP ranks, grouped-query attention, Qwen2's q/k/v biases, Mistral's window."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install 'mmm[hf]'")
    shape = dict(vocab_size=1000, hidden_size=128, intermediate_size=352, num_hidden_layers=4)
    shape |= dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    config = (
        transformers.Qwen2Config(**shape) if kind == "qwen2" else transformers.MistralConfig(**shape, sliding_window=64)
    )
    config.save_pretrained(path)
    return path / "config.json"


def _expected_local_params(config_json: Path, *, tp: int, dp: int, dp_rank: int, tp_rank: int) -> int:
    """The parameters one rank holds, worked out here from the model's own parameters and its config's TP
    plan: colwise shards dim 0 (weight and bias) over tp, rowwise a weight's dim 1; then FSDP2 gives dp rank
    r rows [r c, (r + 1) c) of dim 0, c = ceil(rows / dp) (torch.chunk)."""
    import fnmatch

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_json.parent)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = {f"model.{k}": v for k, v in config.base_model_tp_plan.items()}
    total = 0
    for name, p in model.named_parameters():
        module, _, kind = name.rpartition(".")
        style = next(
            (s for pattern, s in plan.items() if fnmatch.fnmatchcase(module, pattern.replace("*", "[0-9]*"))), None
        )
        shape = list(p.shape)
        if style == "colwise":
            assert shape[0] % tp == 0
            shape[0] //= tp
        elif style == "rowwise" and kind == "weight":
            shape[1] //= tp
        rows = shape[0]
        c = math.ceil(rows / dp)
        mine = max(0, min(rows, (dp_rank + 1) * c) - dp_rank * c)
        total += mine * math.prod(shape[1:])
    assert tp_rank in range(tp)
    return total


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_a_hugging_face_config_alone_is_simulated_at_64_ranks_with_exact_state(tmp_path, kind):
    """--recipe hf --hf-config config.json: the model built on meta from the config alone (no weights),
    FSDP 32 x TP 2 by the config's own TP plan; ranks 0 and 63 hold exactly the parameters worked out
    independently here (uneven shards included), their gradients the same, AdamW twice as much."""
    config = _hf_config(tmp_path / kind, kind)
    out = tmp_path / "sim.json"
    flags = ["--recipe", "hf", "--hf-config", str(config), "--world", "64", "--tp", "2", "--seq-len", "64"]
    res = run([*SIMULATE, *flags, "--batch-size", "64", "--json", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    reports = {r["rank"]: r for r in json.loads(out.read_text())}
    assert set(reports) == {0, 63}
    for rank, (dp_rank, tp_rank) in {0: (0, 0), 63: (31, 1)}.items():
        r = reports[rank]
        expected = _expected_local_params(config, tp=2, dp=32, dp_rank=dp_rank, tp_rank=tp_rank)
        assert r["local_params"] == expected, (rank, r["local_params"], expected)
        assert r["param_bytes"] == 4 * expected and r["grad_bytes"] == 4 * expected, r
        assert r["optim_bytes"] == 8 * expected, r
        assert r["step"]["comm_bytes"]["tp"] > 0 and r["step"]["peak"]["total"] > r["param_bytes"], r["step"]


def test_a_hugging_face_config_trains_through_the_one_trainer(tmp_path):
    """python -m mmm.training.trainer --recipe hf: a transformers causal LM of a config.json, random
    weights from the seed, TP 2 x the pipeline's 2 stages: one process's losses and gradient norms."""
    config = _hf_config(tmp_path / "qwen2", "qwen2")
    args = ["-m", "mmm.training.trainer", "--recipe", "hf", "--hf-config", str(config), "--max-iters", "3"]
    args += ["--seq-len", "32", "--batch-size", "4", "--no-plots"]
    one = run([sys.executable, *args, "--outdir", str(tmp_path / "one")], timeout=120)
    assert one.returncode == 0, one.output
    four = run(launch("-n", "4", "python3", *args, "--pp", "2", "--tp", "2", "--outdir", str(tmp_path / "pp2tp2")))
    assert four.returncode == 0, four.output
    # transformers imports torchao (when installed): its import's noise on a CPU build is not shown
    assert "Failed to load" not in four.stderr and "register_constant" not in four.stderr, four.stderr
    for key in ("loss", "grad_norm"):
        got, ref = (jsonl(tmp_path / d / "history.jsonl", key) for d in ("pp2tp2", "one"))
        assert max_rel_diff(got, ref) < 1e-5, (key, got, ref)
    res = run([sys.executable, *args, "--cp", "2"], timeout=60)
    assert_clean_user_error(res, "unrecognized arguments: --cp 2; --cp: no context parallel for transformers models")
    res = run([sys.executable, "-m", "mmm.training.trainer", "--recipe", "nosuch"], timeout=60)
    assert_clean_user_error(res, "--recipe 'nosuch': give one of llama, vit, cnn, hf or module:NAME")
    # a config of a model that is no causal LM: refused where the config is read, not when it is built
    import transformers

    from mmm.errors import UsageError
    from mmm.models.hf.recipe import HF_CAUSAL_LM, HFModel, load_hf_config

    transformers.T5Config().save_pretrained(tmp_path / "t5")
    with pytest.raises(UsageError, match="model_type 't5' has no causal LM in transformers"):
        load_hf_config(str(tmp_path / "t5"))
    # what a checkpoint records of the model: not the transformers version that wrote the config
    summary = HF_CAUSAL_LM.summary(HFModel(load_hf_config(str(config)), 32))
    assert summary["model_type"] == "qwen2" and "transformers_version" not in summary and summary["seq_len"] == 32


def test_the_vit_recipe_is_picked_at_8_ranks(tmp_path):
    """The planner takes mmm's ViT as it takes the Llama: every valid layout of 8 ranks simulated and
    ranked; the pick's flags are the ViT trainer's own (no --pp or --cp, which it does not have)."""
    from mmm.models.vit.recipe import VIT

    out = tmp_path / "vit.json"
    res = run(
        [*SIMULATE, "--recipe", "vit", "--world", "8", "--pick", "--hardware", "h100", "--json", str(out)], timeout=180
    )
    assert res.returncode == 0, res.output
    rows = json.loads(out.read_text())
    assert {r["degrees"]["tp"] for r in rows} >= {1, 2, 4} and all(r["degrees"]["pp"] == 1 for r in rows), rows
    assert [r["step_s"] for r in rows if r["fits"]] == sorted(r["step_s"] for r in rows if r["fits"])
    config = VIT.command_line().parse(rows[0]["flags"])
    assert not VIT.problems(config, 8) and config.parallel.degrees == rows[0]["degrees"] | {"dp_shard": -1}


def test_a_recipe_names_what_it_lacks_in_one_line(tmp_path, monkeypatch):
    """Recipes found by name fail in one line: a module whose own import fails, a missing NAME, a recipe
    the planner cannot simulate (no example_batch); a CNN checkpoint records what it did before 0.2."""
    from mmm.errors import UsageError
    from mmm.models.cnn.recipe import DIGITS, DigitsConfig
    from mmm.training.recipe import Recipe, load_recipe

    (tmp_path / "broken_recipe.py").write_text("import no_such_dependency\n")
    (tmp_path / "bare_recipe.py").write_text(
        "from mmm.training.recipe import Recipe\nBARE = Recipe()\ndef build():\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match="importing broken_recipe needs 'no_such_dependency', which is not installed"):
        load_recipe("broken_recipe:R")
    with pytest.raises(UsageError, match="bare_recipe has no 'MISSING'"):
        load_recipe("bare_recipe:MISSING")
    with pytest.raises(UsageError, match="is a function, not an .*Recipe .a function that builds your model is enough"):
        load_recipe("bare_recipe:build")  # a model's build function: verify takes it, the planner a recipe
    bare = load_recipe("bare_recipe:BARE")
    assert isinstance(bare, Recipe)
    with pytest.raises(UsageError, match="has no example_batch: the planner and mmm.verify need"):
        bare.example_batch(None, rows=1)
    assert DIGITS.summary(DigitsConfig(img_size=8)) == {"type": "DigitsCNN", "img_size": 8, "num_params": 151_306}


def test_the_trainer_checks_the_accumulation_of_a_recipe_that_does_not():
    """--microbatches is every trainer's: a recipe of your own whose problems() says nothing of it still has
    a --microbatches that does not split each rank's batch refused before the run (not at its first step)."""
    from mmm.models.llama.recipe import LLAMA
    from mmm.training.trainer import checked

    config = LLAMA.command_line().parse(["--batch-size", "8", "--microbatches", "3"])
    assert checked(lambda c, w: [])(config, 2) == [
        "--microbatches 3 does not divide the per-dp-rank batch 4 (the global batch over the data-parallel ranks); "
        "use a divisor of 4, e.g. 2 or 4"
    ]
    assert len(checked(LLAMA.problems)(config, 2)) == 1  # mmm's recipe says it already: once
    good = LLAMA.command_line().parse(["--batch-size", "8", "--microbatches", "2"])
    assert checked(lambda c, w: [])(good, 2) == []
