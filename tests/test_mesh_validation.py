"""Mesh degree validation: every violation at once, values named, fixes suggested."""

import pytest

from mmm.parallel import MeshError, ParallelDims, check_degrees


def test_inference_of_the_minus_one_degree():
    d = ParallelDims(world_size=8, tp=2)
    assert d.degrees == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2}
    assert d.dp == 4 and d.tp_enabled and d.dp_shard_enabled and not d.pp_enabled and d.fsdp_enabled
    d = ParallelDims(world_size=16, pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=-1)
    assert d.tp == 2 and d.size("dp_cp") == 4 and d.size("dp_shard_cp") == 2
    assert d.enabled_axes() == ("pp", "dp_replicate", "cp", "tp")


def test_tp_that_does_not_divide_world_names_valid_choices():
    _, problems = check_degrees(4, tp=3, dp_shard=-1)
    assert problems == ["tp=3 does not divide world size 4; valid tp for 4 ranks: 1, 2, 4"]


def test_every_violation_is_listed_at_once():
    with pytest.raises(MeshError) as e:
        ParallelDims(world_size=12, tp=5, cp=0, pp=-1, dp_shard=-1)
    msg = str(e.value)
    assert msg.startswith("invalid mesh for 12 ranks: ")
    assert "tp=5 does not divide world size 12; valid tp for 12 ranks: 1, 2, 3, 4, 6, 12" in msg
    assert "cp=0 is invalid; a degree is a positive integer, or -1 to infer it" in msg
    assert "only one degree may be -1 (inferred); got -1 for pp and dp_shard" in msg
    assert "\n" not in msg  # one line


def test_product_mismatch_suggests_inference():
    _, problems = check_degrees(8, tp=2, dp_shard=2)
    assert problems == [
        "pp=1 x dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 = 4 ranks, but the world size is 8; "
        "set one degree to -1 to infer it (e.g. dp_shard=-1) or launch 4 ranks"
    ]


def test_fixed_degrees_that_cannot_be_completed():
    _, problems = check_degrees(12, tp=4, cp=2, dp_shard=-1)
    assert len(problems) == 1
    assert (
        "(cp=2, tp=4) multiply to 8, which does not divide world size 12, so dp_shard=-1 cannot be inferred"
        in problems[0]
    )


def test_unknown_axis_and_bad_types():
    _, problems = check_degrees(4, sp=2, tp=2.0)
    assert "unknown mesh axis sp" in problems[0]
    assert "tp=2.0 is invalid" in problems[1]


def test_expert_parallel_borrows_from_dp_shard_and_cp():
    resolved, problems = check_degrees(8, dp_shard=-1, cp=2, ep=4)
    assert not problems and resolved["ep"] == 4 and resolved["dp_shard"] == 4
    _, problems = check_degrees(8, dp_shard=-1, tp=4, ep=4)
    assert problems == [
        "ep=4 does not divide dp_shard x cp = 2 x 1 = 2: expert parallel borrows its ranks from them; "
        "valid ep here: 1, 2"
    ]
    _, problems = check_degrees(8, dp_shard=-1, ep=0)
    assert problems == ["ep=0 is invalid; the expert-parallel degree is a positive integer"]
    _, problems = check_degrees(8, dp_shard=-1, dp_replicate=2, ep=2)
    assert "ep=2 with dp_replicate=2 (HSDP) is not supported" in problems[0]
    dims = ParallelDims(world_size=8, cp=2, ep=4)
    assert (dims.ep, dims.efsdp, dims.size("ep"), dims.degrees["ep"]) == (4, 2, 4, 4)
    assert str(dims).endswith("ep=4 (of dp_shard x cp) (8 ranks)")
    _, problems = check_degrees(0)
    assert problems == ["world size 0 must be a positive integer"]


def test_what_a_mesh_cannot_run_is_named_before_any_step():
    """Selective checkpointing with expert parallel or a zero-bubble pipeline, and compile with expert parallel,
    failed deep in backward or in the compiled step (tracebacks of ~300 lines); named in the API's spelling."""
    from mmm.parallel import ParallelSpec, compose_problems
    from mmm.parallel.compose import ac_problems

    ep = ParallelDims(world_size=2, ep=2)
    spec = ParallelSpec(ac="selective", ep_plan={"layers.*.moe.experts": "experts"})
    assert any("ac='selective' with ep=2 fails in backward" in p for p in compose_problems(spec, ep))
    assert not any("ac=" in p for p in compose_problems(ParallelSpec(ac="full", ep_plan=spec.ep_plan), ep))
    pp = ParallelDims(world_size=2, pp=2)
    assert any("schedule='interleaved-zb'" in p for p in ac_problems("selective", pp, schedule="interleaved-zb"))
    assert ac_problems("selective", pp, schedule="interleaved-1f1b") == []
    assert ac_problems("full", pp, schedule="interleaved-zb") == []
    compiled = ParallelSpec(compile=True, ep_plan=spec.ep_plan)
    assert any("compile=True with ep=2 is not supported" in p for p in compose_problems(compiled, ep))
