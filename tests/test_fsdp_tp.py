"""fsdp_tp trainer: every mesh/strategy gives the single-process losses (fp32, real ranks), outputs, bad input."""

import json
import sys

import pytest

from conftest import jsonl, launch, max_rel_diff, on_ranks, run, tiny_llama

# Tiny but complete: GQA (8 query / 4 kv heads), 2 blocks, every TP split in the matrix valid.
MODEL = tiny_llama(max_iters=6, lr="3e-3", seed=3)
RTOL = 1e-5
MODULE = ["-m", "mmm.examples.fsdp_tp"]


def losses(outdir):
    return jsonl(outdir / "history.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    res = run([sys.executable, *MODULE, *MODEL, "--outdir", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    return losses(out)


def test_outputs_and_log_lines(tmp_path):
    res = run(
        launch("-n", "4", "python3", *MODULE, *MODEL[:-1], "--tpsize", "2", "--outdir", str(tmp_path)), timeout=240
    )
    assert res.returncode == 0, res.output
    step_lines = [line for line in res.stdout.splitlines() if " iter=" in line]
    assert len(step_lines) == 6  # one line per step, rank 0 only
    for key in ("loss=", "dt=", "dtf=", "dtb=", "tps="):
        assert key in step_lines[0]
    assert "initializing tensor parallel with size 2" in res.stdout
    assert "Total params" in res.stdout  # torchinfo summary
    assert "FSDPTransformerBlock" in res.stdout or "FSDP" in res.stdout  # the model after parallelisation
    assert "startup " in res.stdout
    s = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "world_size",
        "mesh",
        "strategy",
        "final_loss",
        "stats",
        "memory_per_rank",
        "startup_s",
        "startup_phases",
        "versions",
        "mfu",
    ):
        assert key in s, key
    assert s["mesh"]["tp"] == 2 and s["mesh"]["dp_shard"] == 2
    assert list(s["startup_phases"]) == [
        f"{p}_s" for p in ("interpreter", "imports", "process_group", "mesh", "model", "parallelize", "first_step")
    ]
    assert abs(sum(s["startup_phases"].values()) - s["startup_s"]) < 0.05
    assert 0 < s["mfu"] < 1 and s["flops"]["flops_per_unit"] > 0
    assert s["compile"] is False and s["compiled_graphs"] == 0
    for metric in ("dt", "dtf", "dtb", "tps"):
        assert s["stats"][metric]["n"] == 4  # 6 steps, 2 warmup excluded
    assert {"history.jsonl", "history.nc", "summary.json", "plots"} <= {p.name for p in tmp_path.iterdir()}
    assert (tmp_path / "plots" / "loss.txt").exists() and (tmp_path / "plots" / "loss.png").exists()


def test_fsdp_state_is_a_quarter_on_four_ranks(tmp_path):
    res = run(on_ranks(4, *MODULE, *MODEL, "--outdir", str(tmp_path)), timeout=240)
    assert res.returncode == 0, res.output
    s = json.loads((tmp_path / "summary.json").read_text())
    quarter = s["model"]["num_params"] * 16 / 4  # fp32 params + grads + 2 Adam moments, over 4 ranks
    assert s["state_bytes_theory"]["total_bytes"] == quarter
    for rank_mem in s["memory_per_rank"]:
        assert rank_mem["total_bytes"] <= 1.05 * quarter, (rank_mem, quarter)


@pytest.mark.parametrize("dataset", ["synthetic", "pydoc"])
def test_loss_falls(tmp_path, dataset):
    res = run(
        launch(
            "-n",
            "2",
            "python3",
            *MODULE,
            "--dim",
            "64",
            "--n-layers",
            "2",
            "--n-heads",
            "4",
            "--seq-len",
            "64",
            "--batch-size",
            "8",
            "--max-iters",
            "30",
            "--dataset",
            dataset,
            "--no-plots",
            "--tp",
            "2",
            "--outdir",
            str(tmp_path),
        ),
        timeout=240,
    )
    assert res.returncode == 0, res.output
    got = losses(tmp_path)
    first, last = sum(got[:3]) / 3, sum(got[-3:]) / 3
    assert last < 0.75 * first, (first, last)


@pytest.mark.parametrize("n, flags", [(2, []), (2, ["--pp", "2", "--microbatches", "2"])], ids=["dp2", "pp2"])
def test_compiled_blocks_match_single_process(reference, tmp_path, n, flags):
    res = run(
        launch("-n", str(n), "python3", *MODULE, *MODEL, "--compile", *flags, "--outdir", str(tmp_path)), timeout=300
    )
    assert res.returncode == 0, res.output
    assert max_rel_diff(losses(tmp_path), reference) <= RTOL
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["compile"] is True and s["compiled_graphs"] >= 1  # torch.compile really captured the blocks


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_bf16")
    res = run([sys.executable, *MODULE, *MODEL, "--dtype", "bf16", "--outdir", str(out)], timeout=180)
    assert res.returncode == 0, res.output
    # one rank: FSDP2's bf16 compute copies (no sharding), not an autocast over fp32 weights
    assert json.loads((out / "summary.json").read_text())["mixed_precision"] == "fsdp"
    return losses(out)


@pytest.mark.parametrize(
    "n, flags",
    [
        (4, ["--tp", "2"]),  # FSDP2's mixed-precision policy
        (2, ["--tp", "2"]),  # pure TP: FSDP2 on a one-rank dp mesh beside TP's, casting only
        (4, ["--pp", "2", "--microbatches", "2"]),  # pipeline stages with FSDP (dp 2)
    ],
    ids=["dp2-tp2", "tp2", "pp2-dp2"],  # (pipeline stages at dp 1: tp2's one-rank casting, pp2-dp2's stages)
)
def test_bf16_really_computes_in_bf16(reference, bf16_reference, tmp_path, n, flags):
    """bf16 moves the losses off the fp32 ones (so it is on) and stays near one process in bf16."""
    res = run(on_ranks(n, *MODULE, *MODEL, *flags, "--dtype", "bf16", "--outdir", str(tmp_path)), timeout=240)
    assert res.returncode == 0, res.output
    got = losses(tmp_path)
    assert max_rel_diff(bf16_reference, reference) > RTOL  # one process: bf16 differs from fp32
    assert max_rel_diff(got, reference) > RTOL, (got, reference)  # beyond fp32 equivalence: bf16 is not off
    assert max_rel_diff(got, bf16_reference) < 2e-2, (got, bf16_reference)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["dtype"], summary["mixed_precision"]) == ("bf16", "fsdp")
