"""--export-hf: the trained Llama as a Hugging Face checkpoint that transformers loads.

Trained 3 steps at dp 2 x tp 2 (FSDP + TP shards gathered) and at pp 2 x dp 2 (the second stage
sent to rank 0), the exported model, run by transformers' LlamaForCausalLM, gives mmm's logits and
the loss the uninterrupted run computes at step 4 (the weights after step 3, the batch of step 4).
Round trip: --init-from the export, one step at lr 0, exports the same tensors again.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import SCRIPTS, jsonl, launch, run

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")

MODULE = ["-m", "mmm.examples.fsdp_tp"]
# GQA (8 query / 4 kv heads) so that the query and key permutations differ in size
TINY = [
    "--dim",
    "64",
    "--n-layers",
    "2",
    "--n-heads",
    "8",
    "--n-kv-heads",
    "4",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--seed",
    "3",
    "--no-plots",
]
RTOL = 1e-5


def ok(cmd, timeout=240):
    res = run(cmd, timeout=timeout)
    assert res.returncode == 0, res.output
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    ok(
        launch(
            "-n",
            "4",
            "python3",
            *MODULE,
            *TINY,
            "--tp",
            "2",
            "--max-iters",
            "3",
            "--export-hf",
            str(root / "tp"),
            "--outdir",
            str(root / "run_tp"),
        )
    )
    ok(
        launch(
            "-n",
            "4",
            "python3",
            *MODULE,
            *TINY,
            "--pp",
            "2",
            "--max-iters",
            "3",
            "--export-hf",
            str(root / "pp"),
            "--outdir",
            str(root / "run_pp"),
        )
    )
    ok([sys.executable, *MODULE, *TINY, "--max-iters", "4", "--outdir", str(root / "straight")], timeout=180)
    # round trip: start from the export, one step that changes nothing (lr 0), export again
    ok(
        [
            sys.executable,
            *MODULE,
            "--init-from",
            str(root / "tp"),
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--seed",
            "3",
            "--no-plots",
            "--lr",
            "0",
            "--max-iters",
            "1",
            "--export-hf",
            str(root / "again"),
            "--outdir",
            str(root / "run_again"),
        ],
        timeout=180,
    )
    res = ok(
        [
            sys.executable,
            str(SCRIPTS / "hf_export_check.py"),
            str(root / "tp"),
            str(root / "pp"),
            "--seq-len",
            "32",
            "--batch-size",
            "8",
            "--seed",
            "3",
            "--steps",
            "0,3",
        ],
        timeout=180,
    )
    return root, json.loads(res.stdout.strip().splitlines()[-1])


def test_transformers_loads_the_export_and_gives_mmms_logits(runs):
    root, check = runs
    config = json.loads((root / "tp" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
        config["tie_word_embeddings"],
    ) == (64, 8, 4, 256, False)
    for name in ("tp", "pp"):
        got = check[str(root / name)]
        assert got["max_abs_diff"] <= 1e-5 * max(1.0, got["logits_std"]), got
        assert not got["warnings"], got["warnings"]


@pytest.mark.parametrize("name", ["tp", "pp"], ids=["dp2-tp2", "pp2-dp2"])
def test_exported_weights_are_the_trained_ones(runs, name):
    """transformers' loss of the export on step 4's batch = the uninterrupted run's step 4."""
    root, check = runs
    straight = jsonl(root / "straight" / "history.jsonl")
    theirs = check[str(root / name)]["losses"]["3"]
    assert abs(theirs - straight[3]) <= RTOL * abs(straight[3]), (theirs, straight)
    assert abs(theirs - straight[2]) > 1e-3  # not the weights of the step before


def test_init_from_the_export_round_trips(runs):
    from safetensors.torch import load_file

    root, check = runs
    first = jsonl(root / "run_again" / "history.jsonl")[0]
    theirs = check[str(root / "tp")]["losses"]["0"]  # transformers, the export, step 1's batch
    assert abs(first - theirs) <= RTOL * abs(theirs), (first, theirs)
    a, b = load_file(str(root / "tp" / "model.safetensors")), load_file(str(root / "again" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)
    assert json.loads((root / "tp" / "config.json").read_text()) == json.loads(
        (root / "again" / "config.json").read_text()
    )


def test_export_is_refused_where_the_model_is_deepspeeds(tmp_path):
    res = run([sys.executable, *MODULE, *TINY, "--strategy", "zero2", "--export-hf", str(tmp_path / "x")], timeout=60)
    assert res.returncode == 2, res.output
    assert "--export-hf gathers the torch-sharded model; --strategy zero2 hands the model to DeepSpeed" in res.stderr
