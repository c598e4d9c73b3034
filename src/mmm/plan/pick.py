"""The planner's pick for a job about to train: ``--pick-layout HARDWARE`` of the fsdp_tp trainer.

Rank 0 runs ``python -m mmm.plan.simulate --pick`` in a process of its own (a fake process group of
the job's world, no launcher variables, so it never takes itself for a rank of the job) with the
trainer's own flags, and every rank takes the layout it ranks first; the trainer logs it with its
reasons and writes it to summary.json (``layout_pick``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from mmm.cli import without_flags
from mmm.dist import without_launcher_vars
from mmm.errors import UsageError
from mmm.plan.hardware import load_hardware

FLAG = "--pick-layout"


def planners_pick(argv: Sequence[str], world: int, hardware: str, *, devices_per_node: int | None = None) -> dict:
    """Rank the layouts of ``world`` ranks for the trainer flags ``argv`` on ``hardware`` and return the
    pick: ``label``, ``degrees``, ``strategy``, ``ac`` and ``microbatches`` (where the planner chose them,
    else None), ``flags``, ``predicted_step_s``, ``why``, ``hardware``, ``ranked`` (the best five) and
    ``seconds`` (the planner's own time). A pick that cannot be made is
    a :class:`UsageError` naming ``--pick-layout``. ``devices_per_node``: the job's ranks per host (which
    groups cross hosts follows from it), else the hardware's."""
    try:
        hw = load_hardware(hardware)
    except UsageError as e:
        raise UsageError(str(e).replace("--hardware", FLAG)) from None
    trainer = without_flags(argv, {FLAG})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmm-pick-") as tmp:
        out = Path(tmp) / "ranked.json"
        cmd = [sys.executable, "-m", "mmm.plan.simulate", "--world", str(world), "--pick", "--hardware", hardware]
        if devices_per_node:
            cmd += ["--devices-per-node", str(devices_per_node)]
        cmd += ["--json", str(out), *trainer]
        env = {**without_launcher_vars(), "MMM_LOG_LEVEL": "WARNING", "MMM_RICH": "0"}
        # the planner ends when this rank does (killed by its launcher): mmm.plan.simulate asks the kernel
        env["MMM_END_WITH_PARENT"] = str(os.getpid())
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            lines = res.stderr.strip().splitlines() or ["(no output)"]
            if res.returncode == 2:  # the planner's one-line refusal
                raise UsageError(f"{FLAG} {hardware}: {lines[-1].split('error: ', 1)[-1]}")
            raise RuntimeError(f"{FLAG}: the planner failed (exit {res.returncode}):\n" + "\n".join(lines[-20:]))
        ranked = json.loads(out.read_text())
    best = ranked[0]
    if not best["fits"]:
        raise UsageError(
            f"{FLAG} {hardware}: no layout of {world} ranks fits in {hw.memory_bytes / 2**30:.0f} GiB per device "
            "(more activation checkpointing, a smaller --batch-size or more ranks)"
        )
    return {
        "hardware": hw.name,
        "label": best["label"],
        "degrees": best["degrees"],
        "strategy": best["strategy"],
        "ac": best["ac"],
        "microbatches": best["microbatches"],
        "flags": best["flags"],
        "predicted_step_s": best["step_s"],
        "why": best["why"],
        "ranked": [{k: r[k] for k in ("label", "step_s", "fits", "why")} for r in ranked[:5]],
        "layouts": len(ranked),
        "seconds": time.perf_counter() - t0,
    }
