"""Pipeline parallel in fsdp_tp: stage splitting, schedules, and losses equal to one process (real ranks)."""

import pytest
import torch
from torch import nn

from conftest import jsonl, launch, max_rel_diff, run, run_ranks, single_process_run, tiny_llama
from mmm.models.llama import Llama, LlamaConfig
from mmm.parallel.pipeline import outer_modules, pipeline_problems, split_model, stage_ids, stage_layer_ranges

MODULE = ["-m", "mmm.examples.fsdp_tp"]
MODEL = tiny_llama(n_layers=8, max_iters=5, lr="3e-3", seed=5)
RTOL = 1e-5


def test_stage_ranges_and_placement():
    assert stage_layer_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layer_ranges(8, 3, [2, 5]) == [(0, 2), (2, 5), (5, 8)]
    assert stage_ids(1, 2, 2) == [1, 3]  # looped: rank 1 of pp=2 holds stages 1 and 3


def test_split_model_keeps_names_and_only_its_blocks():
    model = Llama(LlamaConfig(dim=32, n_layers=4, n_heads=4, vocab_size=64, seq_len=8))
    mid = split_model(model, (1, 3), first=False, last=False)
    assert list(mid.layers.keys()) == ["1", "2"]
    assert isinstance(mid.tok_embeddings, nn.Identity) and isinstance(mid.output, nn.Identity)
    names = {n for n, _ in mid.named_parameters()}
    assert "layers.1.attention.wq.weight" in names and all(n.startswith("layers.") for n in names)
    first = split_model(model, (0, 1), first=True, last=False)
    assert isinstance(first.tok_embeddings, nn.Embedding) and list(first.layers.keys()) == ["0"]
    assert model.layers["0"].attention.wq.weight.data_ptr() != first.layers["0"].attention.wq.weight.data_ptr()


class _Inner(nn.Module):  # the shape of a Hugging Face causal LM: model.{embed, layers (a list), norm, rotary}
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
        self.norm = nn.LayerNorm(4)
        self.rotary = nn.Module()  # no parameters: stays on every stage

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers[:4]:  # slices, as HF's forward does
            h = layer(h)
        return (self.norm(h),)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Inner()
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        return {"x": self.head(self.model(x)[0])}["x"]


def test_split_module_list_keeps_full_names_and_runs_its_own_forward():
    model = _Outer()
    pre, post = outer_modules(model, "model.layers")
    assert pre == ["model.embed"] and sorted(post) == ["head", "model.norm"]
    mid = split_model(model, (1, 3), first=False, last=False)
    assert sorted(n for n, _ in mid.named_parameters()) == [
        "model.layers.1.bias",
        "model.layers.1.weight",
        "model.layers.2.bias",
        "model.layers.2.weight",
    ]
    x = torch.randn(2, 3, 4)
    assert torch.equal(mid(x), model.model.layers[2](model.model.layers[1](x)))  # tuple output -> its tensor
    first = split_model(model, (0, 1), first=True, last=False)
    assert isinstance(first.model.embed, nn.Embedding) and isinstance(first.head, nn.Identity)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            dict(n_layers=6, schedule="gpipe", stages_per_rank=1, microbatches=2, local_batch=4, pp=4),
            "n_layers=6 does not split evenly into 4 stages",
        ),
        (
            dict(n_layers=8, schedule="gpipe", stages_per_rank=1, microbatches=3, local_batch=4, pp=2),
            "microbatches=3 does not divide the per-dp-rank batch 4",
        ),
        (
            dict(n_layers=8, schedule="interleaved-1f1b", stages_per_rank=1, microbatches=2, local_batch=4, pp=2),
            "schedule='interleaved-1f1b' interleaves several stages per rank",
        ),
        (
            dict(n_layers=8, schedule="zigzag", stages_per_rank=1, microbatches=2, local_batch=4, pp=2),
            "unknown schedule='zigzag'",
        ),
    ],
)
def test_pipeline_problems_name_values(kwargs, needle):
    problems = pipeline_problems(**kwargs)
    assert any(needle in p for p in problems), problems


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return jsonl(single_process_run(tmp_path_factory, "single", [*MODULE, *MODEL]) / "history.jsonl")


def test_own_model_example_script():
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "pipeline_own_model.py"
    res = run(launch("-n", "2", "python3", str(script)), timeout=120)
    assert res.returncode == 0, res.output
    assert "pipeline losses match one process over 5 steps" in res.stdout


@pytest.fixture(scope="module")
def clipped_reference(tmp_path_factory):
    out = single_process_run(tmp_path_factory, "single_clip", [*MODULE, *MODEL, "--grad-clip", "0.5"])
    return jsonl(out / "history.jsonl", key=None)


@pytest.mark.parametrize(
    "flags",
    [
        ["--pp", "2", "--microbatches", "2"],  # pp2 x dp2: norms summed over stages
        ["--pp", "2", "--tp", "2", "--microbatches", "2"],  # pp2 x tp2: over stages and TP shards
        ["--tp", "2"],  # dp2 x tp2 (FSDP + TP DTensors)
        ["--strategy", "zero2", "--tp", "1"],  # DeepSpeed clips by its config
    ],
    ids=["pp2-dp2", "pp2-tp2", "dp2-tp2", "zero2"],
)
def test_global_grad_norm_clipping_matches_single_process(clipped_reference, tmp_path, flags):
    run_ranks(4, [*MODULE, *MODEL, "--grad-clip", "0.5", *flags], tmp_path)
    assert any(r["grad_norm"] > 0.5 for r in clipped_reference)  # clipping really happens
    for key in ("loss", "grad_norm"):
        want = [r[key] for r in clipped_reference]
        assert max_rel_diff(jsonl(tmp_path / "history.jsonl", key), want) <= RTOL, key
