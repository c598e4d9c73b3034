"""--export-hf: the trained Llama as a Hugging Face checkpoint that transformers loads.

Trained 3 steps at dp 2 x tp 2 (FSDP + TP shards gathered) and at pp 2 x dp 2 (the second stage
sent to rank 0), the exported model, run by transformers' LlamaForCausalLM, gives mmm's logits and
the loss the uninterrupted run computes at step 4 (the weights after step 3, the batch of step 4).
Round trip: --init-from the export, one step at lr 0, exports the same tensors again.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, jsonl, launch, run, tiny_llama

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")

MODULE = ["-m", "mmm.examples.fsdp_tp"]
# GQA (8 query / 4 kv heads) so that the query and key permutations differ in size
TINY = tiny_llama(seed=3)
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


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
        modes = {f.name: f.stat().st_mode & 0o777 for f in (root / name).iterdir()}  # the umask's, not 0600
        assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~_umask(), modes


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


# --------------------------------------------------------------------------- nothing lost
def _tiny_llama():
    import torch

    from mmm.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=16)
    return Llama(cfg), cfg


def test_an_export_never_deletes_what_its_folder_held(tmp_path, monkeypatch):
    """--export-hf into a folder that holds weights (an earlier export, or the very checkpoint the run
    started from with --init-from): the old files are moved aside whole, after the new export (its tokenizer
    too) is complete; an index naming a file outside the folder deletes nothing; a full disk mid-write leaves
    the folder as it was."""
    import safetensors.torch

    from mmm.errors import RunError
    from mmm.models.llama import export_hf_llama

    model, cfg = _tiny_llama()
    victim = tmp_path / "victim.txt"
    victim.write_text("not a shard")
    dest = tmp_path / "m" / "llama"
    dest.mkdir(parents=True)
    (dest / "model-00001-of-00001.safetensors").write_bytes(b"the original weights")
    (dest / "tokenizer.json").write_text("{}")
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "../../victim.txt"}})
    )
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    tokenizer = {"tokenizer.json": b'{"new": 1}'}
    for failing in (safetensors.torch, "save_file"), (Path, "write_bytes"):  # the weights; the tokenizer after
        monkeypatch.setattr(*failing, full_disk)
        with pytest.raises(RunError, match=r"no space left in .*nothing there was changed"):
            export_hf_llama(model, dest, cfg, files=tokenizer)
        assert {p.name: p.read_bytes() for p in dest.iterdir()} == before  # untouched
        assert sorted(p.name for p in dest.parent.iterdir()) == ["llama"]  # no half-written export left
        monkeypatch.undo()

    export_hf_llama(model, dest, cfg, files=tokenizer)
    assert victim.read_text() == "not a shard"
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (dest / "tokenizer.json").read_bytes() == tokenizer["tokenizer.json"]
    (aside,) = [p for p in dest.parent.iterdir() if p.name.startswith("llama.old-")]
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before  # every old file, intact


def test_damaged_weights_are_refused_in_one_line_naming_the_file(tmp_path):
    """--init-from a folder whose model.safetensors is cut short or not safetensors at all, whose index is not
    JSON or has no weight_map, or names a shard that is not there: one line naming the file, no traceback."""
    from mmm.errors import UsageError
    from mmm.models.llama import export_hf_llama, load_hf_llama

    model, cfg = _tiny_llama()
    good = tmp_path / "good"
    export_hf_llama(model, good, cfg)
    weights = (good / "model.safetensors").read_bytes()
    cases = {
        "cut": {"model.safetensors": weights[: len(weights) // 2]},
        "junk": {"model.safetensors": b"junk\n"},
        "index-not-json": {"model.safetensors.index.json": b"{"},
        "index-without-map": {"model.safetensors.index.json": b'{"metadata": {}}'},
        "index-names-nothing-there": {"model.safetensors.index.json": b'{"weight_map": {"a": "gone.safetensors"}}'},
    }
    for name, files in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_bytes((good / "config.json").read_bytes())
        for file, data in files.items():
            (folder / file).write_bytes(data)
        with pytest.raises(UsageError) as e:
            load_hf_llama(_tiny_llama()[0], folder)
        line = str(e.value)
        assert "\n" not in line and str(folder) in line, (name, line)
        assert "cannot be read as safetensors" in line or "is not a safetensors index" in line or "lacks" in line, line
