"""The equivalence matrix: every parallel layout gives one process's per-step loss AND global
gradient norm (fp32, real ranks, gloo). AdamW hides a constant factor on the gradients, so the loss
alone cannot catch a sum-versus-mean bug over dp, cp or microbatches; the gradient norm does.

One table (case name, ranks, flags, launcher), one runner, one single-process reference per base
configuration, computed once and shared.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass

import pytest

from conftest import (
    BIN,
    SHORT_CNN,
    TINY_VIT,
    Result,
    env_of,
    jsonl,
    launch,
    max_rel_diff,
    mpi_env,
    pbs_job,
    run,
    tiny_llama,
    torchrun,
)

RTOL = 1e-5

# base configurations: the trainer and the flags every case of that base shares
BASES = {
    # tiny but complete: GQA (8 query / 4 kv heads), every TP split in the matrix valid
    "llama": ["-m", "mmm.examples.fsdp_tp", *tiny_llama(max_iters=5, lr="3e-3", seed=3)],
    # 8 blocks: pipelines of 2, 4 and interleaved 2x2 / 4x2 stages
    "llama8": ["-m", "mmm.examples.fsdp_tp", *tiny_llama(n_layers=8, max_iters=5, lr="3e-3", seed=5)],
    # the same with the global gradient norm clipped at 0.5 (one process's steps clip): a wrong global
    # norm shows in the recorded norm and, through the clip, in the next steps' losses
    "llama8-clip": ["-m", "mmm.examples.fsdp_tp", *tiny_llama(n_layers=8, max_iters=5, lr="3e-3", seed=5)]
    + ["--grad-clip", "0.5"],
    "vit": TINY_VIT,
    "cnn": SHORT_CNN,
    # a mixture of experts: 8 experts, top-2, a shared expert, the sequence-wise auxiliary loss and a fast
    # balancing bias (every step moves routing), so a count that is not the global batch's shows
    "moe": [
        "-m",
        "mmm.examples.fsdp_tp",
        *tiny_llama(max_iters=5, lr="3e-3", seed=2),  # routing never closer than 2.9e-5 to a tie
        *("--moe-experts 8 --moe-top-k 2 --moe-shared 1 --moe-aux 1e-2 --moe-bias-rate 1e-2".split()),
    ],
}


@dataclass(frozen=True)
class Case:
    name: str
    base: str
    ranks: int
    flags: tuple[str, ...] = ()
    launcher: str = "launch"  # or torchrun; or "pbs/openmpi", "pbs/mpich": launch in a PBS job on two hosts

    @property
    def two_hosts(self) -> bool:
        return self.launcher.startswith("pbs/")

    def run(self, outdir, request) -> Result:
        # a stuck collective ends the run within 150 s, saying which (mmm's own timeout), and its output is
        # kept: before pytest's 300 s would end the test with nothing to read
        args = [*BASES[self.base], *self.flags, "--timeout", "150", "--outdir", str(outdir)]
        if self.launcher == "torchrun":
            return run(torchrun(self.ranks, *args), timeout=280)
        if not self.two_hosts:
            return run(launch("-n", str(self.ranks), "python3", *args), timeout=280)
        # launch on the first host of a 2-host PBS job; mpiexec reaches the second through the agent
        hosts = request.getfixturevalue("two_hosts")
        flavor = self.launcher.split("/")[1]
        envdir = BIN.parent if flavor == "openmpi" else mpi_env(flavor)
        job = pbs_job(hosts, outdir, ranks_per_host=self.ranks // 2, PATH=env_of(envdir)["PATH"])
        cmd = [str(envdir / "bin" / "python"), "-m", "mmm.launch", "python3", *args]
        return run(hosts.command("node1", cmd), env=job, timeout=300)


def C(name, base, ranks, flags="", launcher="launch") -> Case:
    return Case(name, base, ranks, tuple(flags.split()), launcher)


# launch (local) for most rows; torchrun for three (its agent imports torch, ~2 s of CPU a run), two hosts
# under PBS for two: the launchers themselves are tested in test_multirank, test_mpi_flavors, test_multihost
MATRIX = [
    # data parallel and tensor parallel (llama)
    C("fsdp-dp2-tp2-clip", "llama8-clip", 4, "--tpsize 2"),  # the demo's layout, clipped over its 2-D shards
    C("fsdp-dp2-tp4", "llama", 8, "--tp 4", "torchrun"),
    C("fsdp-dp2-no-reshard", "llama", 2, "--tp 1 --reshard-after-forward false"),  # (FSDP alone: held)
    C("hsdp-2x2-tp2-ac-full", "llama", 8, "--strategy hsdp --dp-replicate 2 --tp 2 --ac full"),
    # two hosts: HSDP's replicate axis (gradient all-reduce) across them, each shard group inside one;
    # a pipeline with one stage per host
    C("hosts2-hsdp-2x2", "llama", 4, "--strategy hsdp --dp-replicate 2", "pbs/openmpi"),
    # context parallel (ring cp 2 alone: the accumulation rows; cp 2 x tp 2: the 4-D row)
    C("cp4", "llama", 4, "--cpsize 4 --dp-shard 1"),
    C("dp2-cp2", "llama", 4, "--cp 2"),
    # all-to-all (Ulysses) context parallel: heads split over cp; cp4 x tp2 repeats K/V (2 kv heads per TP
    # rank over 4 cp ranks; cp 2 alone and cp2 x tp2 are trimmed: these and the experts' row hold them)
    C("ulysses-cp4", "llama", 4, "--cp 4 --dp-shard 1 --cp-attention ulysses"),
    C("ulysses-cp4-tp2", "llama", 8, "--cp 4 --tp 2 --cp-attention ulysses"),
    C("pp2-cp2-tp2", "llama", 8, "--pp 2 --cp 2 --tp 2 --microbatches 2"),
    # pipeline parallel: each schedule once alone (1f1b and interleaved at pp 4; at pp 2: trimmed, the
    # two-host and composed rows run pp 2), gpipe with an uneven split (layers 0-2 | 3-7)
    C("pp2-gpipe-split-at-3", "llama8", 2, "--pp 2 --pp-schedule gpipe --split-points 3 --microbatches 4"),
    C("pp4-1f1b", "llama8", 4, "--pp 4 --pp-schedule 1f1b --microbatches 8"),
    C("pp4-interleaved", "llama8", 4, "--pp 4 --pp-schedule interleaved-1f1b --stages-per-rank 2 --microbatches 4"),
    C("pp2-dp2-clip", "llama8-clip", 4, "--pp 2 --microbatches 2"),  # norms summed over stages
    C("pp2-tp2-clip", "llama8-clip", 4, "--pp 2 --tp 2 --microbatches 2 --measure"),  # over stages and TP shards
    C("hosts2-pp2-dp2", "llama8", 4, "--pp 2 --pp-schedule 1f1b --microbatches 2", "pbs/mpich"),
    # a mixture of experts, expert parallel (ep borrows its ranks from dp_shard x cp): alone, under FSDP over
    # the rest, across a pipeline, with the experts' width over tp, with ring and all-to-all context parallel
    # (ep 2 alone: the accumulation row)
    C("moe-dp4-ep2-ac-selective", "moe", 4, "--ep 2 --ac selective"),  # (efsdp 2; at 1 it is refused)
    C("moe-pp2-dp2-ep2", "moe", 4, "--pp 2 --ep 2 --microbatches 2"),
    C("moe-ep2-tp2", "moe", 4, "--tp 2 --ep 2", "torchrun"),
    C("moe-dp2-cp2-ep2", "moe", 4, "--cp 2 --ep 2"),
    C("moe-dp2-ulysses-cp2-ep4", "moe", 4, "--cp 2 --cp-attention ulysses --ep 4"),
    # replicated experts (ep 1): HSDP (the balancing counts over every data-parallel rank) and DDP
    C("moe-hsdp-2x2", "moe", 4, "--strategy hsdp --dp-replicate 2"),
    C("moe-ddp-dp2", "moe", 2, "--strategy ddp"),
    # gradient accumulation (--microbatches without a pipeline; --measure: each row's activation peak is one
    # microbatch's): FSDP x TP clipped, HSDP (its all-reduce deferred), DDP (no_sync), DeepSpeed's own, and
    # experts (their balancing loss's gradient scaled with the others)
    C(
        "acc2-fsdp-dp2-tp2-clip-ac-sel",
        "llama8-clip",
        4,
        "--tp 2 --microbatches 2 --ac selective --on-nonfinite skip --measure",
    ),
    # (HSDP 2x2 without accumulation: the two-host row, and with tp and AC)
    C("acc2-hsdp-2x2", "llama", 4, "--strategy hsdp --dp-replicate 2 --microbatches 2 --measure"),
    C("acc4-ddp-dp2", "llama", 2, "--strategy ddp --microbatches 4 --measure"),
    C("acc2-zero2-dp2-clip", "llama8-clip", 2, "--strategy zero2 --microbatches 2 --measure"),  # DeepSpeed clips
    C("acc2-moe-dp2-ep2", "moe", 2, "--ep 2 --microbatches 2 --measure"),
    # context parallel's ring with accumulation and full AC, a pick the planner can make
    C("acc2-cp2-ac-full", "llama", 2, "--cp 2 --dp-shard 1 --ac full --microbatches 2 --measure"),
    # the ViT: FSDP on 4 ranks (its 10-class head sharded unevenly), ZeRO-1 and ZeRO-3 on 2 (ZeRO-2: the
    # Llama's and the CNN's rows), and TP x FSDP (DDP, one generic wrapper: the Llama's and the experts' rows)
    C("vit-fsdp-dp4", "vit", 4, "--strategy fsdp"),
    C("vit-zero1-dp2", "vit", 2, "--strategy zero1", "torchrun"),  # DeepSpeed under torchrun
    C("vit-zero3-dp2", "vit", 2, "--strategy zero3"),
    C("vit-tp2-dp2", "vit", 4, "--tp 2"),
    # the CNN on 2 ranks, its per-epoch evaluation too: FSDP and ZeRO-2 (ZeRO-1 and ZeRO-3: the ViT's rows)
    *[C(f"cnn-{s}-dp2", "cnn", 2, f"--strategy {s}") for s in ("fsdp", "zero2")],
]


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The output folder of the single-process run of each base, made on first use, once per test session:
    under pytest-xdist the first worker that needs it makes it (a file lock), the others read it."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the workers' own folders sit in this session's
        root = root.parent

    def get(base: str):
        out, done = root / f"single-{base}", root / f"single-{base}.done"
        with FileLock(str(root / f"single-{base}.lock")):
            if not done.exists():
                shutil.rmtree(out, ignore_errors=True)
                res = run([sys.executable, *BASES[base], "--outdir", str(out)], timeout=180)
                assert res.returncode == 0, res.output
                done.touch()
        return out

    return get


# a mixture of experts routes each token to its top-k experts: scores closer than this at the k-th place
# could route differently on another layout (its reduction orders move scores of ~0.1 by ~1e-8)
MIN_MARGIN = 1e-6


def routing_margin_holds(rows: list[dict], name: str) -> None:
    """Fails, saying so, when the reference's routing has a near-tie (no flake: same seed, same data)."""
    margins = [r["moe_margin"] for r in rows if "moe_margin" in r]
    if margins and min(margins) < MIN_MARGIN:
        pytest.fail(
            f"{name}: routing near-tie: the k-th and next expert's scores came within {min(margins):.2e} "
            f"(< {MIN_MARGIN:g}); another layout may route differently: choose another --seed"
        )


def compare(got: list[dict], want: list[dict], keys=("loss", "grad_norm")) -> dict[str, float]:
    """Max relative difference per key over the steps; each key must be recorded at every step."""
    out = {}
    for key in keys:
        a, b = [r.get(key) for r in got], [r.get(key) for r in want]
        assert None not in a and None not in b, (key, a, b)
        out[key] = max_rel_diff(a, b)
    return out


# in make test-fast whatever their time: the demo's layout (TP x FSDP) and a pipeline over FSDP
FAST_ROWS = {"fsdp-dp2-tp2-clip", "pp2-dp2-clip"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.fast] if c.name in FAST_ROWS else []) for c in MATRIX]
)
def test_layout_matches_one_process(references, tmp_path, case, request):
    if case.two_hosts:  # the hosts' /tmp is their own: write where both see it
        tmp_path = request.getfixturevalue("shared_dir")
    res = case.run(tmp_path, request)
    assert res.returncode == 0, res.output
    ref = references(case.base)
    want = jsonl(ref / "history.jsonl", key=None)
    routing_margin_holds(want, case.base)
    if case.base.endswith("-clip"):  # clipping really happens in the reference
        assert any(r["grad_norm"] > 0.5 for r in want), [r["grad_norm"] for r in want]
    keys = ("loss", "grad_norm", "moe_load_max", "moe_aux") if case.base == "moe" else ("loss", "grad_norm")
    diffs = compare(jsonl(tmp_path / "history.jsonl", key=None), want, keys=keys)
    assert all(d <= RTOL for d in diffs.values()), (case.name, diffs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == case.ranks and len(summary["memory_per_rank"]) == case.ranks
    flags = dict(zip(case.flags, case.flags[1:]))
    if int(flags.get("--tp", flags.get("--tpsize", 1))) > 1:
        assert "tp:Shard(0)" in res.stdout  # the sharding table shows the TP plan
    if "--microbatches" in flags and "--pp" not in flags:  # gradient accumulation really ran
        n = int(flags["--microbatches"])
        assert summary["accumulation"] == {"microbatches": n}, summary.get("accumulation")
        assert f"gradient accumulation: {n} microbatches of " in res.stdout
        for rank in summary["measured_per_rank"]:  # a microbatch's activations at a time: 1/n of the step's
            assert rank["activation_peak_bytes"] <= rank["activation_bytes"] / n * 1.05, rank
    if "--measure" in case.flags and int(flags.get("--tp", 1)) > 1 and case.base != "moe":
        # besides the layout's own collectives, a step does exactly one, on the world group: loss, non-finite
        # and stop flags and the norm, packed (with tp > 1 no mesh axis spans the world and lends it its name;
        # the experts' balancing adds its own)
        for rank in summary["measured_per_rank"]:
            calls = rank["comm_calls"]
            assert calls.get("world") == 1 and "other" not in calls, (case.name, calls)
            assert rank["comm_bytes"]["world"] == 16, rank["comm_bytes"]  # four fp32 numbers
    if case.base == "cnn":  # the per-epoch evaluation over the sharded test set, too
        got, want = jsonl(tmp_path / "epochs.jsonl", key=None), jsonl(ref / "epochs.jsonl", key=None)
        assert compare(got, want, keys=("train_loss", "test_loss")) == pytest.approx(
            {"train_loss": 0, "test_loss": 0}, abs=RTOL
        )
        assert [r["test_acc"] for r in got] == [r["test_acc"] for r in want]
