"""Models larger than one device: meta-device construction, mesh-invariant initialisation, sharded
loading of Hugging Face safetensors checkpoints, and per-rank memory that stays below the model."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import assert_clean_user_error, jsonl, launch, run, tiny_llama
from mmm.errors import UsageError

SCRIPTS = Path(__file__).parent / "scripts"


def tiny_cfg(n_layers=3):
    from mmm.models.llama import LlamaConfig

    return LlamaConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=8)


def test_meta_init_allocates_no_parameters_and_keeps_buffers():
    from mmm.models.llama import Llama, rope_table
    from mmm.parallel import meta_init

    with meta_init():
        model = Llama(tiny_cfg())
    assert all(p.is_meta for p in model.parameters())
    assert not model.rope.is_meta and torch.equal(model.rope, rope_table(8, 8, 10000.0))
    assert not next(nn.Linear(2, 2).parameters()).is_meta  # the patch ends with the block


def test_building_on_meta_runs_no_initialiser_and_counts_in_closed_form():
    """On meta, torch's random initialisers run Python reference kernels whose first call imports torch._dynamo
    (~0.5 s of CPU a rank): building under meta_init and counting skip them (a fresh process shows it)."""
    code = """if True:
        import sys
        from mmm.models.llama import Llama, LlamaConfig
        from mmm.models.llama.recipe import LLAMA
        from mmm.parallel import meta_init
        from mmm.parallel.meta import count_params
        cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, seq_len=8)
        with meta_init():
            model = Llama(cfg)
        assert all(p.is_meta for p in model.parameters())
        assert "torch._dynamo" not in sys.modules, "meta_init ran an initialiser"
        print(count_params(lambda: Llama(cfg)), sum(p.numel() for p in model.parameters()), LLAMA.param_count(cfg))
    """
    res = run([sys.executable, "-c", code], timeout=60)
    assert res.returncode == 0, res.output
    counted, built, closed = map(int, res.stdout.split())
    assert counted == built == closed > 0
    from mmm.models.llama import LlamaConfig
    from mmm.models.llama.recipe import LLAMA
    from mmm.parallel.meta import count_params

    for cfg in (LlamaConfig(moe_experts=4, moe_top_k=2, moe_shared=1, n_layers=2), LlamaConfig(n_layers=2)):
        assert LLAMA.param_count(cfg) == count_params(lambda: LLAMA.build(cfg)), cfg


def test_weights_depend_on_the_seed_and_the_name_only():
    """A sequential RNG would give layer 2 other values once layer 1 is gone; seeding by name does not."""
    from mmm.models.llama import Llama
    from mmm.parallel import materialize, meta_init

    def build(seed, drop=None):
        with meta_init():
            model = Llama(tiny_cfg())
        if drop is not None:
            del model.layers[drop]
        return dict(materialize(model, device="cpu", seed=seed).named_parameters())

    full, again, other, holed = build(7), build(7), build(8), build(7, drop="1")
    for name, p in full.items():
        assert torch.equal(p, again[name]), name
        if name in holed:
            assert torch.equal(p, holed[name]), name
        if "norm" not in name:
            assert not torch.equal(p, other[name]), name
    assert torch.equal(full["layers.0.ffn_norm.weight"], torch.ones(32))  # the model's own init ran
    assert abs(full["layers.2.attention.wq.weight"].std().item() - 0.02) < 0.005


def test_the_initialisation_of_a_torch_module_is_reset_parameters():
    from mmm.parallel import materialize, meta_init

    with meta_init():
        model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    materialize(model, device="cpu", seed=0)
    bound = 1 / 4**0.5  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert model[0].weight.abs().max() <= bound and model[0].weight.std() > 0
    assert torch.equal(model[1].weight, torch.ones(3))


def test_tied_parameters_stay_tied():
    from mmm.parallel import materialize, meta_init

    with meta_init():
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        model[1].weight = model[0].weight
    materialize(model, device="cpu", seed=0)
    assert model[1].weight is model[0].weight and model[0].weight.std() > 0


def test_a_parameter_the_init_forgets_is_refused():
    from mmm.parallel import materialize, meta_init

    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def init_weights(self):
            self.a.reset_parameters()  # b forgotten

    with meta_init():
        model = Half()
    with pytest.raises(UsageError, match="b.weight was not initialised by Half.init_weights"):
        materialize(model, device="cpu", seed=0)


def test_what_cannot_be_materialised_is_refused_by_name():
    from mmm.models.llama import Llama
    from mmm.parallel import ParallelDims, materialize, meta_init, parallelize

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with meta_init():
        bare = Bare()
    with pytest.raises(UsageError, match="scale has no initialiser: Bare has no reset_parameters"):
        materialize(bare, device="cpu", seed=0)
    with torch.device("meta"):
        model = Llama(tiny_cfg())
    with pytest.raises(UsageError, match="buffer rope is on meta.*meta_init"):
        materialize(model, device="cpu", seed=0)
    with meta_init():
        model = Llama(tiny_cfg())
    with pytest.raises(UsageError, match="pass seed= so") as e:
        parallelize(model, SimpleNamespace(dims=ParallelDims(world_size=1)), device=torch.device("cpu"))
    assert str(e.value).count("meta device") == 1, e.value
    with pytest.raises(UsageError, match="Llama is on the meta device: pass device= and seed= so") as e:
        parallelize(model, SimpleNamespace(dims=ParallelDims(world_size=1)))  # both missing: one problem
    assert str(e.value).count("meta device") == 1, e.value


UNINITIALISABLE = """
import torch
from torch import nn
from mmm.parallel import init_mesh, meta_init, parallelize

class WithScale(nn.Module):  # a parameter of its own and no reset_parameters()
    def __init__(self):
        super().__init__()
        self.proj, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(1))

with meta_init():
    model = WithScale()
try:
    parallelize(model, init_mesh(), device=torch.device("cpu"), seed=0)
except Exception as e:
    print("refused:", e, flush=True)
"""


def test_an_fsdp_unit_without_an_initialiser_is_named_by_its_own_class():
    """FSDP2 swaps the root's class for FSDPWithScale: the refusal names the user's class and both fixes."""
    res = run(launch("-n", "2", "python3", "-c", UNINITIALISABLE), timeout=120)
    assert res.returncode == 0, res.output
    want = (
        "refused: scale has no initialiser: WithScale has no reset_parameters(); give the model an init_weights() "
        "method, or parallelize(..., init=fn)"
    )
    assert res.stdout.count(want) == 2, res.output


def test_parallelize_names_what_it_was_given_instead():
    """Wrong types gave AttributeErrors from deep inside (mesh['dp'] has no dims); a second call stacked the plans
    (torch's AssertionError)."""
    from mmm.parallel import ParallelDims, ParallelSpec, parallelize

    one = SimpleNamespace(dims=ParallelDims(world_size=1))
    with pytest.raises(UsageError, match="takes the mesh init_mesh\\(\\) returns, not a int .*pass the whole mesh"):
        parallelize(nn.Linear(2, 2), 3)
    with pytest.raises(UsageError, match="takes an nn.Module, not a dict"):
        parallelize({}, one)
    with pytest.raises(UsageError, match="spec is a dict; give a ParallelSpec"):
        parallelize(nn.Linear(2, 2), one, {"dp": "fsdp"})
    model = nn.Linear(2, 2)
    flat = SimpleNamespace(dims=one.dims, tp_enabled=False, ep_enabled=False, dp_enabled=False, get=lambda axis: None)
    parallelize(model, flat, ParallelSpec(dp="none"))  # one rank, no data parallel: the model as it is
    with pytest.raises(UsageError, match="Linear went through parallelize\\(\\) already; build a fresh model"):
        parallelize(model, flat, ParallelSpec(dp="none"))


def test_every_mesh_materialises_one_process_weights(tmp_path):
    """dp2 x tp2 (FSDP's strided 2-D shards), activation checkpointing: the full tensors of every
    parameter equal one process's, bit for bit."""
    res = run(
        launch("-n", "4", "python3", str(SCRIPTS / "meta_init_check.py"), "--tp", "2", "--ac", "full"), timeout=180
    )
    assert res.returncode == 0, res.output
    assert res.stdout.count("30 parameters, 0 differ") == 4, res.output


# --------------------------------------------------------------------------- Hugging Face checkpoints
@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    """A tiny random Llama saved by transformers: untied in one file; tied in six shards + an index.
    Only the tests that use it need transformers (a module-level skip hid the others)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'mmm[hf]')")
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, tied in (("untied", False), ("tied", True)):
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=tied,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(root / name, max_shard_size="60KB" if tied else "1GB")
        out[name] = root / name
    assert (out["tied"] / "model.safetensors.index.json").exists()
    return out


def test_config_maps_to_mmm_llama(hf_checkpoints):
    from mmm.models.llama import llama_config_from_hf

    cfg = llama_config_from_hf(hf_checkpoints["untied"], seq_len=16)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.ffn_hidden, cfg.seq_len) == (
        64,
        2,
        4,
        2,
        128,
        96,
        16,
    )


# (mmm's Llama from the untied checkpoint under TP: one process's logits are transformers' in test_hf's
# rope-scaling test, and pp2 x tp2 gives one process's first loss in test_trainer_starts_from_a_checkpoint)
@pytest.mark.parametrize(
    "ckpt,flags",
    [("tied", []), ("tied", ["--tp", "2", "--hf-model"])],
    ids=["mmm-fsdp4-sharded-files", "hf-model-dp2-tp2"],
)
def test_loaded_sharded_model_gives_transformers_logits(hf_checkpoints, ckpt, flags):
    res = run(launch("-n", "4", "python3", str(SCRIPTS / "hf_load.py"), str(hf_checkpoints[ckpt]), *flags), timeout=240)
    assert res.returncode == 0, res.output
    diffs = [
        float(line.split("max abs diff ")[1].split()[0]) for line in res.stdout.splitlines() if "max abs diff" in line
    ]
    assert len(diffs) == 4 and max(diffs) <= 1e-5, res.output


def test_trainer_starts_from_a_checkpoint(hf_checkpoints, tmp_path):
    """--init-from: the same first loss on one process and on pp2 x dp2 x ... and not the loss of a fresh model."""
    common = ["--init-from", str(hf_checkpoints["untied"]), "--seq-len", "16", "--max-iters", "2", "--no-plots"]
    one = run([sys.executable, "-m", "mmm.examples.fsdp_tp", *common, "--outdir", str(tmp_path / "one")], timeout=120)
    assert one.returncode == 0, one.output
    four = run(
        launch(
            "-n",
            "4",
            "python3",
            "-m",
            "mmm.examples.fsdp_tp",
            *common,
            "--pp",
            "2",
            "--tp",
            "2",
            "--outdir",
            str(tmp_path / "four"),
        ),
        timeout=240,
    )
    assert four.returncode == 0, four.output
    fresh = run(
        [
            sys.executable,
            "-m",
            "mmm.examples.fsdp_tp",
            "--vocab-size",
            "128",
            "--dim",
            "64",
            "--n-layers",
            "2",
            "--n-heads",
            "4",
            "--n-kv-heads",
            "2",
            "--seq-len",
            "16",
            "--max-iters",
            "1",
            "--no-plots",
            "--outdir",
            str(tmp_path / "fresh"),
        ],
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.output
    a, b, c = (jsonl(tmp_path / d / "history.jsonl", key=None) for d in ("one", "four", "fresh"))
    for key in ("loss", "grad_norm"):
        assert abs(a[0][key] - b[0][key]) <= 1e-5 * abs(a[0][key]), key
    assert abs(a[0]["loss"] - c[0]["loss"]) > 1e-3
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["model"]["ffn_hidden_dim"] == 96


def test_bad_checkpoint_flags_are_one_line(tmp_path):
    res = run([sys.executable, "-m", "mmm.examples.fsdp_tp", "--init-from", str(tmp_path / "nope")], timeout=60)
    assert_clean_user_error(res, "nope does not exist; give a Hugging Face checkpoint directory")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 32,
                "intermediate_size": 96,
            }
        )
    )
    res = run([sys.executable, "-m", "mmm.examples.fsdp_tp", "--init-from", str(tmp_path), "--dim", "128"], timeout=60)
    assert_clean_user_error(res, "--dim: with --init-from the model's shape comes from")
    res = run(
        [sys.executable, "-m", "mmm.examples.fsdp_tp", "--init-from", str(tmp_path), "--seq-len", "16"], timeout=60
    )
    assert_clean_user_error(res, "no safetensors checkpoint in")


# --------------------------------------------------------------------------- memory
@pytest.mark.slow
def test_no_rank_holds_the_whole_model(tmp_path):
    """4 ranks, FSDP, one step of a 76M-parameter Llama built on meta: every rank's peak resident memory
    grows by less than 1.5x of the whole model's fp32 bytes over a tiny model's run (params + grads + AdamW
    sharded 4 ways: 1.0x; measured 1.07x; 3.2x with glibc's default mmap threshold, MMM_HOST_MALLOC=default;
    unsharded state would be 4x, a whole model built first 3.5x on 8 ranks).
    The benchmark's default, a 608M model, shows the same at a size no rank could hold (docs/benchmarks.md)."""
    res = run(
        [
            sys.executable,
            str(Path(__file__).parents[1] / "benchmarks" / "memory.py"),
            "--ranks",
            "4",
            "--dim",
            "512",
            "--n-heads",
            "8",
            "--n-layers",
            "24",
            "--outdir",
            str(tmp_path),
        ],
        timeout=900,
    )
    assert res.returncode == 0, res.output
    data = json.loads((tmp_path / "memory.json").read_text())
    assert data["num_params"] > 75e6
    assert data["worst_growth_ratio"] < 1.5, res.stdout
    summary = json.loads((tmp_path / "big" / "summary.json").read_text())
    assert len(summary["memory"]["after_setup"]) == 4 and summary["memory"]["after_setup"][0]["rss_bytes"] > 0


# --------------------------------------------------------------------------- the lean step
# (a step's one small all-reduce besides the layout's collectives: the equivalence rows with --measure and tp)


def test_steps_read_late_are_all_recorded_in_order(tmp_path):
    """With --log-every 4 most steps are read one step late: every step is still in history.jsonl, in
    order, and the same values as a run that reads every step at once."""
    common = ["-m", "mmm.examples.fsdp_tp", "--pp", "2", *tiny_llama(max_iters=7)]
    late = run(
        launch("-n", "2", "python3", *common, "--log-every", "4", "--outdir", str(tmp_path / "late")), timeout=180
    )
    now = run(launch("-n", "2", "python3", *common, "--outdir", str(tmp_path / "now")), timeout=180)
    assert late.returncode == 0 and now.returncode == 0, late.output + now.output
    a, b = (jsonl(tmp_path / d / "history.jsonl", key=None) for d in ("late", "now"))
    assert [r["iter"] for r in a] == list(range(1, 8))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert all(r["dt"] > 0 and r["tps"] > 0 for r in a)
    assert "iter=4 " in late.stderr + late.stdout and "iter=3 " not in late.stderr + late.stdout


def test_a_nan_on_a_stage_that_does_not_hold_the_loss_still_stops_the_run(tmp_path):
    """Under PP only the last stage's loss counts; a NaN on stage 0 travels as the packed non-finite
    flag and stops every rank with one line at that step."""
    res = run(
        launch(
            "-n",
            "2",
            "python3",
            "-m",
            "mmm.examples.fsdp_tp",
            "--pp",
            "2",
            "--max-iters",
            "6",
            "--log-every",
            "3",
            "--no-plots",
            "--outdir",
            str(tmp_path),
        ),
        env={**__import__("os").environ, "MMM_FAULT": "nan@2:0"},
        timeout=180,
    )
    assert res.returncode != 0, res.output
    assert "loss is nan at iter 2" in res.stderr, res.output
    assert [r["iter"] for r in jsonl(tmp_path / "history.jsonl", key=None)] == [1, 2]


@pytest.mark.parametrize("size", [1, 2, 5, 7, 8, 19, 64])
@pytest.mark.parametrize("dim", [0, 1])
def test_lazy_chunks_are_torchs_chunks(size, dim):
    """Each item of mmm's on-demand chunks is what torch's ``_chunk_with_empty`` puts there: the same
    view (storage, offset, shape, strides) or the same empty tensor, for chunk counts below, at and
    past the rows."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from mmm.parallel.fsdp_setup import LazyChunks

    shape = (size, 3) if dim == 0 else (3, size)
    tensor = torch.arange(3 * size, dtype=torch.float32).reshape(shape)
    for n in (1, 2, 3, 4, 8, 9, 70):
        want, got = _chunk_with_empty(tensor, n, dim), LazyChunks(tensor, n, dim)
        assert len(got) == len(want) == n
        assert [tuple(c.shape) for c in got[:]] == [tuple(c.shape) for c in want]
        for i in (*range(n), -1):
            w, g = want[i], got[i]
            assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype), (n, i)
            if w.numel():
                assert g.data_ptr() == w.data_ptr() and g.storage_offset() == w.storage_offset()
                assert torch.equal(g, w)
        with pytest.raises(IndexError):
            got[n]


def test_the_lean_setup_swaps_torchs_functions_only_inside_and_refuses_a_bad_switch(monkeypatch):
    """lean_fully_shard() puts torch's own functions back on exit; MMM_LEAN_FSDP_SETUP=0 leaves them alone;
    a value that is neither on nor off is a one-line error naming it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    from mmm.parallel.fsdp_setup import lean_fully_shard

    before = (_fsdp_param._chunk_with_empty, DeviceMesh.__dict__["_concatenate"], DeviceMesh.__dict__["__getitem__"])
    with lean_fully_shard() as applied:
        assert applied and _fsdp_param._chunk_with_empty is not before[0]
        with lean_fully_shard() as again:  # nested: the outer swap holds
            assert again
    assert (
        _fsdp_param._chunk_with_empty,
        DeviceMesh.__dict__["_concatenate"],
        DeviceMesh.__dict__["__getitem__"],
    ) == before
    monkeypatch.setenv("MMM_LEAN_FSDP_SETUP", "0")
    with lean_fully_shard() as applied:
        assert not applied and _fsdp_param._chunk_with_empty is before[0]
    monkeypatch.setenv("MMM_LEAN_FSDP_SETUP", "maybe")
    with pytest.raises(UsageError, match="MMM_LEAN_FSDP_SETUP='maybe': .* takes 1 or 0"):
        with lean_fully_shard():
            pass


@pytest.mark.parametrize("layout", ["16 2 1 0 15", "48 2 3 0 47"], ids=["fsdp8-tp2", "hsdp3x8-tp2"])
def test_lean_fsdp_setup_shards_as_torch_does_without_per_rank_work(layout):
    """``fully_shard`` through mmm (``mmm.parallel.fsdp_setup``): every parameter's shard, sizes, padding,
    placements and meshes equal torch's own ``fully_shard`` field for field (shapes that leave shard
    ranks empty included), while it builds a few meshes instead of one or two per parameter and none of
    the other ranks' chunks. Fake process groups of 16 and 48 ranks, first and last rank."""
    res = run([sys.executable, str(SCRIPTS / "lean_fsdp.py"), *layout.split()], timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    world, tp, replicate = (int(x) for x in layout.split()[:3])
    dp_shard = world // tp // replicate
    assert len(rows) == len(layout.split()) - 3
    for row in rows:
        assert row["applied"] and row["params"] == 21, row
        assert row["diffs"] == [], row["diffs"][:3]
        plain, lean = row["meshes_made"]
        assert plain >= row["params"] and lean <= 3, row  # torch: one or two per parameter; lean: per group
        plain, lean = row["tensors_made"]
        assert plain - lean >= row["params"] * (dp_shard - 2), row  # the other ranks' chunks, not made
    assert rows[-1]["empty"] > 0  # the last rank's shards of the vocabulary / heads are empty
