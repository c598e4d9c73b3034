"""The end of a run: ``summary.json`` (memory per rank against the strategy's theory, MFU, startup,
versions), ``history.nc``, the plots and the closing line; and what the trainers print about a model."""

from __future__ import annotations

import platform
import sys
from collections.abc import Iterable
from typing import Any

import torch

from mmm import __version__
from mmm.dist import gather_objects
from mmm.flops import mfu_report
from mmm.parallel.strategy import theoretical_state_bytes
from mmm.tracking import finish_run
from mmm.training.memory import peak_memory
from mmm.training.recorder import Recorder
from mmm.training.startup import dropped_hosts, restart_attempt


def versions(extra: Iterable[str] = ()) -> dict[str, str]:
    out = {"mmm": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for name in ("numpy", "deepspeed", "mpi4py", *extra):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "__version__"):
            out[name] = mod.__version__
    return out


def torchinfo_summary(model: torch.nn.Module, depth: int = 2) -> str:
    """torchinfo's parameter table of a (single-device) model."""
    import torchinfo

    return str(torchinfo.summary(model, depth=depth, verbose=0, col_names=("num_params",)))


def compiled_graphs() -> int:
    """Graphs torch.compile has captured in this process so far (0 when nothing was compiled)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def write_summary(
    run: Recorder,
    engine,
    extra: dict[str, Any],
    *,
    mesh,
    num_params: int,
    plots: bool = True,
    rate_key: str = "tps",
    flops_per_unit: float | None = None,
    dtype: str = "fp32",
) -> dict[str, Any]:
    """After the loop, on every rank: gather per-rank memory, compare it with the strategy's
    theoretical figure, work out MFU (``flops_per_unit``: training FLOPs per token, or per sample
    when ``rate_key`` counts samples), write ``history.nc``, ``summary.json`` and the plots, and
    print the closing line; returns the summary."""
    memory = {**(run.memory or engine.state_bytes()), **peak_memory(run.info.device)}
    per_rank = gather_objects(memory)
    marks = gather_objects(run.memory_marks)  # per rank: {"after_setup": {...}, "after_first_step": {...}}
    measured = gather_objects(run.measured) if run.measured is not None else None
    stats = run.hist.stats()
    rate = stats.get(rate_key, {}).get("mean")
    mfu = mfu_report(run.info.device, dtype, rate=rate, flops_per_unit=flops_per_unit)
    summary_extra: dict[str, Any] = {
        "example": run.example,
        "world_size": run.info.world_size,
        "num_nodes": run.info.num_nodes,
        "launcher": run.info.launcher,
        "restart": restart_attempt(),
        "dropped_hosts": dropped_hosts(),
        "device": str(run.info.device),
        "backend": run.info.backend,
        **extra,
        "final_loss": run.hist.rows[-1].get("loss") if run.hist.rows else None,
        "memory_per_rank": per_rank,
        "memory": {phase: [m.get(phase) for m in marks] for phase in ("after_setup", "after_first_step")},
        "mfu": mfu["mfu"],
        "flops": mfu,
        **({"measured_per_rank": measured} if measured is not None else {}),
        "startup_s": run.startup.total_s,
        "startup_phases": run.startup.phases(),
        "stopped_by": run.stopped_by,
        "resumed_from": run.resume_step or None,
        "versions": versions(),
    }
    worst = max(m["total_bytes"] for m in per_rank)
    theory = theoretical_state_bytes(engine.strategy, num_params=num_params, mesh=mesh)
    summary_extra["state_bytes_theory"] = theory
    summary_extra["state_bytes_ratio_to_theory"] = worst / theory["total_bytes"]
    summary = run.hist.finalize(summary_extra, plots=plots)

    finish_run(run, summary, rate_key=rate_key)  # rank 0: summary table, report.md, trackers closed
    if run.info.is_main:
        st = summary["stats"]
        parts = [f"final loss {summary['final_loss']:.4f}"] if summary["final_loss"] is not None else []
        if "dt" in st:
            parts.append(" ".join(f"{k} {st[k]['mean']:.4f}s" for k in ("dt", "dtf", "dtb") if k in st))
        if rate_key in st:
            parts.append(f"{st[rate_key]['mean']:.0f} {rate_key}")
        if mfu["mfu"] is not None:
            parts.append(
                f"MFU {100 * mfu['mfu']:.1f}% ({mfu['peak_source']} peak "
                f"{mfu['peak_flops_per_rank'][0] / 1e12:.3g} TFLOP/s per rank)"
            )
        parts.append(
            f"state {worst / 2**20:.2f} MiB/rank ({worst / theory['total_bytes']:.3f}x of "
            f"{engine.strategy}'s theoretical {theory['total_bytes'] / 2**20:.2f})"
        )
        run.log.info("done: %s | %s", " | ".join(parts), run.outdir)
    return summary
