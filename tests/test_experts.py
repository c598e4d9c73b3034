"""Mixture of experts and expert parallel: the routing itself against a token-by-token reference, a
resume on another expert-parallel degree at the exact data position, bf16 on, and the refusals.
Layouts against one process are rows of the equivalence matrix (tests/test_equivalence.py)."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import SCRIPTS, assert_clean_user_error, jsonl, launch, max_rel_diff, on_ranks, run, tiny_llama
from mmm.models.llama.model import Llama, LlamaConfig
from mmm.models.llama.recipe import LLAMA
from mmm.parallel.optim import SEVERAL_MESHES, torch_version

MODULE = ["-m", "mmm.examples.fsdp_tp"]
MOE = ["--moe-experts", "8", "--moe-top-k", "2", "--moe-shared", "1", "--moe-aux", "1e-2", "--moe-bias-rate", "1e-2"]
MODEL = [*tiny_llama(max_iters=6, lr="3e-3", seed=2), *MOE, "--log-every", "100"]


def tiny_moe(**changes) -> Llama:
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, seq_len=16, moe_experts=4, moe_top_k=2, **changes)
    torch.manual_seed(0)
    return Llama(cfg)


def test_routing_matches_a_token_by_token_reference():
    """Every token goes to exactly its top-k experts (nothing dropped), weighted by its renormalised
    softmax scores; the shared expert is added; the bias moves choice, not weights."""
    model = tiny_moe(moe_shared=1)
    moe = model.layers["0"].moe
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.3, -0.3, 0.0]))
    x = torch.randn(3, 16, 32)
    got = moe(x)
    r, e = moe.router, moe.experts
    want = torch.empty_like(x)
    for b in range(3):
        for t in range(16):
            xt = x[b, t]
            scores = F.linear(xt, r.gate.weight).softmax(-1)
            top = (scores + r.expert_bias).topk(2).indices
            w = scores[top] / scores[top].sum()
            out = sum(
                wi * F.linear(F.silu(F.linear(xt, e.w1[i])) * F.linear(xt, e.w3[i]), e.w2[i]) for wi, i in zip(w, top)
            )
            want[b, t] = out + moe.shared(xt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert r.tokens_per_expert.sum() == 3 * 16 * 2  # k per token, counted once
    assert r.tokens_per_expert[2] < r.tokens_per_expert[1]  # the bias steered choices


def test_auxiliary_loss_trains_the_router_and_balancing_moves_the_bias():
    """The sequence-wise loss reaches the router's gradient through the activations (no term in the loss);
    a balance step moves the bias towards the under-loaded experts and resets the counters."""
    from mmm.parallel.experts import balance_experts, routers

    grads = {}
    for aux in (0.0, 1.0):
        model = tiny_moe(moe_aux=aux, moe_bias_rate=0.1)
        tokens = torch.randint(0, 256, (2, 16))
        model(tokens).float().square().mean().backward()
        grads[aux] = model.layers["0"].moe.router.gate.weight.grad.clone()
    assert not torch.allclose(grads[0.0], grads[1.0])
    (router,) = routers(model)
    counts = router.tokens_per_expert.clone()
    record = balance_experts([router])
    assert torch.equal(torch.sign(router.expert_bias), torch.sign(counts.mean() - counts))
    assert router.tokens_per_expert.sum() == 0 and router.aux_sum.sum() == 0
    assert record["moe_load_max"] == counts.max() / counts.mean() and record["moe_aux"] > 0


def test_a_rank_whose_experts_get_no_token_still_runs_every_all_to_all():
    """Every token goes to ep rank 0's experts: rank 1's experts get none, yet its backward returns its
    tokens' gradients through the all-to-all (rank 0 waits on it) and the gradients are one process's.
    A pipeline's first step met this at random: its shape inference runs a stage on uninitialized inputs."""
    res = run(on_ranks(2, str(SCRIPTS / "ep_no_tokens.py"), "route"), timeout=90)
    assert res.returncode == 0, res.output
    assert re.search(r"rank 1: gradients as one process's \([^)]*\), expert grads 0(?![.\d])", res.stdout), res.stdout
    assert "rank 0: gradients as one process's" in res.stdout, res.stdout


@pytest.mark.parametrize(
    "argv, world, needle",
    [
        (["--ep", "2"], 4, "--ep 2 splits a mixture of experts' experts; add --moe-experts N"),
        (
            ["--moe-experts", "6", "--ep", "4"],
            4,
            "--moe-experts 6 is not divisible by ep=4; each expert-parallel rank "
            "holds as many experts: use --ep 2 or --ep 1 (dividing both 6 and dp_shard x cp = 4)",
        ),
        (["--moe-experts", "1"], 1, "--moe-top-k 2 (its default) must be between 1 and --moe-experts 1"),
        (
            ["--moe-experts", "6", "--ep", "3"],
            4,
            "= 4: expert parallel borrows its ranks from them; valid ep here for 6 experts: 1, 2",
        ),
        (["--moe-experts", "8", "--ep", "2", "--dp-shard", "1", "--pp", "4"], 4, "ep=2 does not divide dp_shard"),
        (["--moe-experts", "4", "--moe-top-k", "5"], 2, "--moe-top-k 5 must be between 1 and --moe-experts 4"),
        (["--moe-experts", "8", "--moe-hidden", "33", "--tp", "2"], 4, "--moe-hidden 33 is not divisible by --tp 2"),
        (["--moe-aux", "0.1"], 2, "--moe-aux 0.1 only applies to a mixture of experts; add --moe-experts N"),
        (["--moe-experts", "8", "--strategy", "zero2"], 2, "--moe-experts with --strategy zero2 is not supported yet"),
        (["--moe-experts", "8", "--strategy", "ddp", "--ep", "2"], 2, "--strategy ddp with --ep 2: DDP replicates"),
        (["--moe-experts", "8", "--export-hf", "x"], 2, "--export-hf writes a dense Hugging Face Llama"),
    ],
)
def test_refusals_name_the_value(argv, world, needle):
    config = LLAMA.command_line().parse([*tiny_llama(), *argv])
    problems = LLAMA.problems(config, world)
    assert any(needle in p for p in problems), problems


def test_a_config_built_in_code_is_refused_when_built():
    """Llama(LlamaConfig(...)) from Python checks what the flags would: not at its first forward (an index
    out of range, a division by zero) nor silently dense (a negative expert count)."""
    for changes, needle in (
        ({"moe_experts": 4, "moe_top_k": 8}, "--moe-top-k 8 must be between 1 and --moe-experts 4"),
        ({"moe_experts": 4, "moe_top_k": 0}, "--moe-top-k 0 must be between 1"),
        ({"moe_experts": -1}, "--moe-experts -1 must be >= 0 (0: a dense model)"),
    ):
        with pytest.raises(ValueError, match=re.escape(needle)):
            Llama(LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=8, **changes))


def test_a_run_whose_tokens_take_every_expert_writes_strict_json(tmp_path):
    """top-k = experts: no next expert, so no routing margin (it was infinity, which JSON cannot spell and
    strict readers refuse): the history and summary parse without NaN or Infinity."""
    res = run([sys.executable, *MODULE, *tiny_llama(max_iters=2), "--moe-experts", "2", "--outdir", str(tmp_path)])
    assert res.returncode == 0, res.output

    def refuse(name):
        raise ValueError(f"{name} in strict JSON")

    rows = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert rows and all("moe_load_max" in r and "moe_margin" not in r for r in rows), rows
    json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)


def test_a_refusal_ends_every_rank_in_one_line():
    res = run(launch("--launcher", "local", "-n", "4", "python3", *MODULE, *tiny_llama(), "--ep", "2"), timeout=90)
    assert_clean_user_error(res, "--ep 2 splits a mixture of experts' experts; add --moe-experts N")


def test_resume_on_another_expert_parallel_degree(tmp_path):
    """Saved on ep 2 (4 ranks) at step 3, resumed on ep 4 and on ep 1 (2 ranks): the same steps 4-6 as
    the run that never stopped, which equals one process (the matrix): expert weights resharded, the
    balancing bias (a saved buffer, moved every step) restored, the data where it stopped."""
    full, ck = tmp_path / "full", tmp_path / "ck"
    res = run(
        on_ranks(
            4,
            *MODULE,
            *MODEL,
            "--ep",
            "2",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "3",
            "--outdir",
            str(full),
        ),
        timeout=240,
    )
    assert res.returncode == 0, res.output
    reference = jsonl(full / "history.jsonl")[3:]
    from torch.distributed.checkpoint import FileSystemReader

    saved = next(p for p in ck.rglob(".metadata"))
    keys = FileSystemReader(str(saved.parent)).read_metadata().state_dict_metadata
    assert any(k.endswith("layers.1.moe.router.expert_bias") for k in keys), sorted(keys)[:20]
    for n, ep in ((4, 4), (2, 1)):
        out = tmp_path / f"ep{ep}"
        flags = ["--ep", str(ep)] if ep > 1 else []
        cmd = launch(
            "-n",
            str(n),
            "python3",
            *MODULE,
            *MODEL,
            *flags,
            "--checkpoint-dir",
            str(ck),
            "--resume",
            "3",
            "--outdir",
            str(out),
        )
        res = run(cmd, timeout=240)
        assert res.returncode == 0, res.output
        got = jsonl(out / "history.jsonl")
        assert [r for r in jsonl(out / "history.jsonl", "iter")] == [4, 5, 6]
        assert max_rel_diff(got, reference) <= 1e-5, (ep, got, reference)
        rows = jsonl(out / "history.jsonl", key=None)
        want = jsonl(full / "history.jsonl", key=None)[3:]
        assert [r["moe_load_max"] for r in rows] == pytest.approx([r["moe_load_max"] for r in want], rel=1e-6)


def test_bf16_is_on_for_the_experts(tmp_path):
    """bf16 under expert parallel moves the losses off fp32's (it is on) and stays near them."""
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    for out, extra in ((fp32, []), (bf16, ["--dtype", "bf16"])):
        res = run(on_ranks(2, *MODULE, *MODEL, "--ep", "2", *extra, "--outdir", str(out)), timeout=240)
        assert res.returncode == 0, res.output
    a, b = jsonl(fp32 / "history.jsonl"), jsonl(bf16 / "history.jsonl")
    assert 1e-5 < max_rel_diff(b, a) < 2e-2, (a, b)
    summary = json.loads((bf16 / "summary.json").read_text())
    assert summary["dtype"] == "bf16"
    # experts on their own mesh beside FSDP's: one fused AdamW takes both (torch >= 2.13)
    assert summary["optimizer"] == ("fused" if torch_version() >= SEVERAL_MESHES else "default"), summary["optimizer"]


def test_the_router_stays_fp32_under_bf16():
    """Routing decides which weights a token meets: under a bf16 autocast (mmm's bf16 without FSDP) the
    router's scores are the fp32 ones, bit for bit; FSDP gives the router a unit of its own, in fp32."""
    router = tiny_moe().layers["0"].moe.router
    x = torch.randn(2, 16, 32)
    want = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert type(router).keep_fp32 is True


# --------------------------------------------------------------------------- the planner
SIM = [sys.executable, "-m", "mmm.plan.simulate"]
SMALL = [*tiny_llama(max_iters=2), "--moe-experts", "8", "--moe-top-k", "2"]


def test_a_simulated_expert_parallel_step_is_the_real_one(tmp_path):
    """The simulator's ep 2 ranks (routing by plan: tensors without values) against a real --measure run:
    state exact; every group's calls exact and its bytes exact but the all-to-all's, which depend on the
    routing (balanced by plan; measured within 0.2%); saved activations within 1%."""
    real = tmp_path / "real"
    res = run(on_ranks(4, *MODULE, *SMALL, "--ep", "2", "--measure", "--outdir", str(real)), timeout=240)
    assert res.returncode == 0, res.output
    sim_json = tmp_path / "sim.json"
    res = run([*SIM, "--world", "4", "--ranks", "0,1,2,3", "--json", str(sim_json), *SMALL, "--ep", "2"], timeout=240)
    assert res.returncode == 0, res.output
    s, sim = json.loads((real / "summary.json").read_text()), json.loads(sim_json.read_text())
    keys = ("param_bytes", "grad_bytes", "optim_bytes", "total_bytes")
    assert [{k: r[k] for k in keys} for r in sim] == [{k: m[k] for k in keys} for m in s["memory_per_rank"]]
    for measured, simulated in zip(s["measured_per_rank"], sim, strict=True):
        step = simulated["step"]
        assert step["comm_calls"] == measured["comm_calls"] and set(step["comm_calls"]) == {"dp_shard", "efsdp", "ep"}
        for group, nbytes in measured["comm_bytes"].items():
            tol = 0.01 if group == "ep" else 0
            assert abs(step["comm_bytes"][group] - nbytes) <= tol * nbytes, (group, step["comm_bytes"], nbytes)
        assert abs(step["activation_bytes"] / measured["activation_bytes"] - 1) < 0.01


def test_the_expert_load_lands_on_the_rank_of_the_first_expert(tmp_path):
    """--expert-load 3: every rank sends 3x the mean to expert 0, so its ep rank (0) receives more than its
    peer and sends back more; balanced, both move the same. ep is all of dp_shard here (torch gives both one
    group): the all-to-all is still ep's, in the simulator and in a real --measure run, and the prediction
    charges it in full (FSDP's dp_shard traffic hides behind the compute)."""
    moved = {}
    for load in ("1", "3"):
        out = tmp_path / f"load{load}.json"
        cmd = [*SIM, "--world", "2", "--ranks", "0,1", "--json", str(out), *SMALL, "--ep", "2", "--expert-load", load]
        cmd += ["--hardware", "h100"] if load == "1" else []
        res = run(cmd, timeout=180)
        assert res.returncode == 0, res.output
        rows = json.loads(out.read_text())
        moved[load] = [r["step"]["comm_bytes"]["ep"] for r in rows]
        kinds = {key for r in rows for key in r["step"]["comm_by_kind"]}  # "<group>.<kind>"
        assert "ep.all_to_all" in kinds and not any(k.endswith("all_to_all") and k != "ep.all_to_all" for k in kinds)
    assert moved["1"][0] == moved["1"][1]
    assert moved["3"][0] > moved["1"][0] > moved["3"][1]
    p = json.loads((tmp_path / "load1.json").read_text())[0]["prediction"]
    assert p["exposed_s"]["ep"] == p["comm_s"]["ep"] > 0, p
    real = tmp_path / "real"
    res = run(on_ranks(2, *MODULE, *SMALL, "--ep", "2", "--measure", "--outdir", str(real)), timeout=180)
    assert res.returncode == 0, res.output
    measured = json.loads((real / "summary.json").read_text())["measured_per_rank"]
    assert [m["comm_calls"] for m in measured] == [rows[0]["step"]["comm_calls"]] * 2, measured


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--expert-load", "2"], "--expert-load 2 applies to a mixture of experts; this model has none"),
        (["--moe-experts", "8", "--expert-load", "9"], "--expert-load 9 must be between 1 (balanced) and 4 (every"),
    ],
)
def test_expert_load_refusals(argv, needle):
    res = run([*SIM, "--world", "2", *tiny_llama(), *argv], timeout=60)
    assert_clean_user_error(res, needle)


def test_the_experts_and_ulysses_all_to_alls_keep_their_axes_on_one_group(tmp_path):
    """ep 2 over all of dp_shard 1 x cp 2: torch gives ep and cp one group, and both send all-to-alls on it.
    Each is counted under its own axis (the experts' sender names ep), not both as ep's."""
    out = tmp_path / "sim.json"
    flags = [*SMALL, "--ep", "2", "--cp", "2", "--cp-attention", "ulysses", "--dp-shard", "1"]
    res = run([*SIM, "--world", "2", "--ranks", "0", "--json", str(out), *flags], timeout=180)
    assert res.returncode == 0, res.output
    kinds = json.loads(out.read_text())[0]["step"]["comm_by_kind"]
    assert kinds["cp.all_to_all"] > 0 and kinds["ep.all_to_all"] > 0, kinds
    assert {k for k in kinds if k.endswith("all_to_all")} == {"cp.all_to_all", "ep.all_to_all"}, kinds


def test_the_pick_ranks_expert_parallel_degrees(tmp_path):
    """--pick on a mixture of experts ranks its ep degrees (those that split the experts) with the rest."""
    out = tmp_path / "pick.json"
    cmd = [*SIM, "--world", "4", *SMALL, "--pick", "--hardware", "h100", "--json", str(out)]
    res = run(cmd, timeout=300)
    assert res.returncode == 0, res.output
    rows = json.loads(out.read_text())
    eps = {r["degrees"].get("ep") for r in rows}
    assert {1, 2, 4} <= eps, eps
    assert "pick: " in res.stdout and all(r["fits"] for r in rows[:1])


def test_the_planner_holds_a_given_expert_parallel_degree():
    """`python -m mmm.plan --ep 2` lists only layouts with ep 2, as it holds the mesh's degrees (the ep was
    varied before, the flag unread); without --ep every ep that fits is listed."""
    from mmm.plan.cli import parse_request, plan_for

    flags = ["--world", "4", *tiny_llama(), "--moe-experts", "4"]
    held = {c.degrees.get("ep", 1) for c in plan_for(parse_request([*flags, "--ep", "2"]))}
    free = {c.degrees.get("ep", 1) for c in plan_for(parse_request(flags))}
    assert held == {2} and free == {1, 2, 4}, (held, free)


def test_the_pick_takes_full_checkpointing_where_selective_cannot_run_with_experts(tmp_path):
    """On a device small enough to need activation checkpointing, --pick tried selective on the ep 2 layout too,
    which fails in backward (torch), and the whole pick died; now ep 2 takes full, the others the least that fits."""
    hw = tmp_path / "small.json"
    hw.write_text(
        json.dumps(
            {"name": "small", "devices_per_node": 8, "memory_gb": 0.0195, "peak_tflops": {"bf16": 989.4, "fp32": 66.9},
             "intra_node_gbps": 450, "inter_node_gbps": 25, "latency_us": 10, "matmul_efficiency": 0.6,
             "memory_bandwidth_gbps": 3350, "memory_efficiency": 0.6, "source": "a test"}
        )
    )  # fmt: skip
    out = tmp_path / "pick.json"
    shape = ["--moe-experts", "4", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "256"]
    res = run([*SIM, "--world", "2", *shape, "--batch-size", "8", "--pick", "--hardware", str(hw), "--json", str(out)],
              timeout=240)  # fmt: skip
    assert res.returncode == 0, res.output
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    ep2 = [r for label, r in rows.items() if "-ep2-" in label]
    assert ep2 and all(r["ac"] == "full" for r in ep2), {k: r["ac"] for k, r in rows.items()}
    assert any(r["ac"] == "selective" for r in rows.values()), {k: r["ac"] for k, r in rows.items()}
