"""Pipeline parallel: stage splitting, its checks, and the own-model example (the schedules' and clipped pipelines'
losses and gradient norms against one process: tests/test_equivalence.py)."""

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import launch, run
from mmm.models.llama import Llama, LlamaConfig
from mmm.parallel.pipeline import outer_modules, pipeline_problems, split_model, stage_ids, stage_layer_ranges


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
            "the model's 6 blocks: no even split into 4 stages",
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


def test_own_model_example_script():
    script = Path(__file__).parents[1] / "examples" / "pipeline_own_model.py"
    res = run(launch("-n", "2", "python3", str(script)), timeout=120)
    assert res.returncode == 0, res.output
    assert "pipeline losses match one process over 5 steps" in res.stdout


def test_a_batch_the_schedule_cannot_take_is_one_line():
    """A batch that does not split into the microbatches, or one of another size than the first step's (the
    stages took their shapes from it), gave torch's shape errors from inside the schedule; refused, every
    rank alike (each is given the batch)."""
    from types import SimpleNamespace

    from mmm.errors import UsageError
    from mmm.parallel.pipeline import Pipeline

    ran = []
    pipe = Pipeline(
        module=nn.Linear(2, 2),
        schedule=SimpleNamespace(step=lambda *args, **kwargs: ran.append(args[0].shape[0])),
        stage_ids=[0],
        num_stages=2,
        layer_ranges=[(0, 1)],
        microbatches=4,
        schedule_name="1f1b",
        pp_group=None,
        loss_parallel=False,
        device=torch.device("cpu"),
    )
    with pytest.raises(UsageError, match="a batch of 10 does not split into 4 microbatches"):
        pipe.step(torch.zeros(10, 3), torch.zeros(10, 3), share_loss=False)
    pipe.step(torch.zeros(8, 3), torch.zeros(8, 3), share_loss=False)
    with pytest.raises(UsageError, match="a batch of 16 after the first step's 8: .* keep the batch size at 8"):
        pipe.step(torch.zeros(16, 3), torch.zeros(16, 3), share_loss=False)
    assert ran == [8]


def test_build_engine_takes_the_microbatches_once():
    """build_engine's microbatches (a pipeline's, or gradient accumulation's) were a pipeline_args entry
    before: that spelling still works, and the two disagreeing are refused before anything is built."""
    from mmm.errors import UsageError
    from mmm.parallel.strategy import build_engine

    with pytest.raises(UsageError, match="microbatches=2 and pipeline_args microbatches=4: give it once"):
        build_engine(
            nn.Linear(2, 2),
            None,
            None,
            strategy="fsdp",
            make_optimizer=None,
            device=torch.device("cpu"),
            microbatches=2,
            pipeline_args={"microbatches": 4},
        )
