"""Context parallel (ring attention) in fsdp_tp and for users' own attention: exact vs one process."""

from pathlib import Path

import pytest
import torch

from conftest import launch, mpiexec, run, tiny_llama
from mmm.errors import UsageError
from mmm.parallel.context import context_parallel, cp_problems, local_positions, shard_sequence

MODULE = ["-m", "mmm.examples.fsdp_tp"]
MODEL = tiny_llama(max_iters=6, lr="3e-3", seed=3)
RTOL = 1e-5


def test_load_balanced_positions():
    # 16 tokens, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    everything = torch.cat([local_positions(32, r, 4) for r in range(4)])
    assert sorted(everything.tolist()) == list(range(32))
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert cp_problems(cp=4, seq_len=36) == [
        "seq_len=36 is not divisible by 2 x cp = 8; context parallel cuts the sequence into 2*cp load-balanced chunks; "
        "use seq_len=32 or seq_len=40"
    ]
    assert cp_problems(cp=2, seq_len=32, tp=2, kind="ulysses", n_heads=6) == [
        "cp_attention='ulysses' splits the query heads over cp=2: n_heads 6 / tp=2 = 3 per TP rank is not "
        "divisible by 2; use a cp that divides it, or cp_attention='ring'"
    ]
    assert cp_problems(cp=2, seq_len=32, kind="spiral") == [
        "unknown context-parallel attention cp_attention='spiral'; choose one of ring, ulysses"
    ]


def test_context_parallel_needs_an_attention_hook_and_positions():
    with pytest.raises(UsageError, match="no module of Linear has an 'attn_fn' attribute"):
        context_parallel(torch.nn.Linear(2, 2), None)
    hooked = torch.nn.Linear(2, 2)
    hooked.attn_fn = None
    with pytest.raises(UsageError, match="Linear has no shard_positions\\(positions\\) method"):
        context_parallel(hooked, None, seq_len=16)
    with pytest.raises(UsageError, match="unknown context-parallel attention kind='spiral'"):
        context_parallel(hooked, None, kind="spiral")
    hooked.shard_positions = lambda positions: None
    with pytest.raises(UsageError, match="cp_mesh is a NoneType, not a 1-D DeviceMesh"):  # mesh.get("cp") at cp=1
        context_parallel(hooked, None, seq_len=16)
    # positions it would never be told: training on the first tokens' positions, silently (a grad norm off)
    with pytest.raises(UsageError, match=r"Linear has a shard_positions\(positions\) method: give context_parallel"):
        context_parallel(hooked, None)


def test_a_sequence_that_does_not_split_into_chunks_is_refused_not_cut():
    """14 tokens over cp=2 (chunks of 3): tokens 12 and 13 were on no rank, silently."""
    with pytest.raises(UsageError, match="14 tokens does not divide into 2 x cp = 4 .* the last 2 would be on no rank"):
        shard_sequence(torch.arange(14)[None], 0, 2)
    with pytest.raises(UsageError, match="cp_rank=2 is not a rank of cp=2"):
        local_positions(16, 2, 2)


PARALLELIZE_CP = """
import torch
from mmm.parallel import context_parallel, init_mesh, parallelize

class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.attn_fn = torch.nn.Linear(8, 8), None

mesh = init_mesh(cp=2)
try:
    parallelize(Attention(), mesh)
except Exception as e:
    print("refused:", e, flush=True)
model = Attention()
context_parallel(model, mesh["cp"])
parallelize(model, mesh)
print("parallelized after context_parallel", flush=True)
"""


def test_a_cp_mesh_needs_context_parallel_attention_before_parallelize():
    """Without context_parallel() each cp rank would attend to its own tokens only: refused, naming the call."""
    res = run(launch("-n", "2", "python3", "-c", PARALLELIZE_CP), timeout=120)
    assert res.returncode == 0, res.output
    assert (
        "refused: the mesh has cp=2 but Attention's attention is not context parallel: call "
        "mmm.parallel.context_parallel(model, mesh['cp'], seq_len=S) before parallelize()" in res.stdout
    ), res.output
    assert res.stdout.count("parallelized after context_parallel") == 2, res.output


@pytest.mark.parametrize("n", [2, 4])
def test_own_attention_example_script(n):
    script = Path(__file__).parents[1] / "examples" / "context_parallel_own_attention.py"
    res = run(mpiexec(n, str(script)) if n == 4 else launch("-n", str(n), "python3", str(script)), timeout=120)
    assert res.returncode == 0, res.output
    for kind in ("ring", "ulysses"):
        assert f"{kind} attention over {n} ranks matches full attention: outputs and gradients" in res.stdout
