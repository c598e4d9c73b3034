"""``python -m mmm``: report the environment and smoke-test collectives over every mesh axis.

Run it under any launcher, e.g. ``launch -n 4 python3 -m mmm --tp 2``. It all-reduces
over the world and over each sub-mesh (every axis of degree > 1 and each flattened
view), checks each sum against the ranks that group should hold, and exits 0 only if
every check passed on every rank.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from mmm import dist
from mmm import env as mmm_env
from mmm.cli import ArgumentParser, MeshConfig, add_flags, from_flags, nonempty_text
from mmm.errors import UsageError
from mmm.log import get_logger


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m mmm",
        description=__doc__.split("\n\n")[0].strip(),
        epilog="Environment: MMM_DEVICE (auto|cpu|cuda|xpu|mps), MMM_BACKEND, MMM_TIMEOUT (s), "
        "LOG_FROM_ALL_RANKS=1 (print every rank's coordinate line).",
    )
    add_flags(p, (MeshConfig, None))  # --tp/--tpsize, --pp, --cp, --dp-replicate, --dp-shard
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda", "xpu", "mps"],
        default=None,
        help="device to test (default: MMM_DEVICE or auto)",
    )
    p.add_argument(
        "--report-dir",
        type=nonempty_text,
        default=None,
        metavar="DIR",
        help="write each rank's report (coordinates, group members, checks) to DIR/rank<N>.json",
    )
    return p


def _spans(ranks: list[int]) -> str:
    """0, 1, 2, 5 -> '0-2, 5'."""
    out: list[str] = []
    for r in ranks:
        if out and r == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.report_dir = Path(args.report_dir) if args.report_dir is not None else None
    if args.report_dir is not None and args.report_dir.exists() and not args.report_dir.is_dir():
        raise UsageError(f"--report-dir {args.report_dir} exists and is not a directory; pass a directory path")

    from mmm.parallel import init_mesh  # torch: after the flags are parsed

    log = get_logger()
    info = dist.setup(device=args.device)
    import torch
    import torch.distributed as tdist

    log.info("%s", dist.banner(info))
    mesh = init_mesh(**from_flags(MeshConfig, args).degrees)
    hosts: list[str] = [""] * info.world_size  # every rank's host, to number the nodes in rank order
    if info.world_size > 1:
        tdist.all_gather_object(hosts, socket.gethostname())
    else:
        hosts = [socket.gethostname()]
    order = list(dict.fromkeys(hosts))
    node = order.index(socket.gethostname())
    log.info("hosts: %s", ", ".join(f"node {i} {h} (ranks {_spans([r for r, x in enumerate(hosts) if x == h])})"
                                     for i, h in enumerate(order)))  # fmt: skip

    checks: list[dict] = []
    rank = info.rank

    def check(name: str, group, members: list[int]) -> None:
        t0 = time.perf_counter()
        t = torch.tensor([float(rank + 1)], device=info.device)
        tdist.all_reduce(t, group=group)
        got, want = t.item(), float(sum(r + 1 for r in members))
        checks.append(
            {
                "name": name,
                "members": members,
                "got": got,
                "want": want,
                "ok": got == want and rank in members,
                "ms": 1e3 * (time.perf_counter() - t0),
            }
        )

    def exchange(name: str, group, members: list[int]) -> None:
        """An all-to-all (expert parallel's token exchange, all-to-all context parallel's): each rank sends
        every peer its own number."""
        t0 = time.perf_counter()
        me = members.index(rank)
        send = torch.tensor([float(rank * 1000 + j) for j in range(len(members))], device=info.device)
        got = torch.empty_like(send)
        tdist.all_to_all_single(got, send, group=group)
        want = [float(src * 1000 + me) for src in members]
        ok = got.tolist() == want
        checks.append({"name": name, "kind": "all-to-all", "members": members, "got": got.tolist(), "want": want,
                       "ok": ok, "ms": 1e3 * (time.perf_counter() - t0)})  # fmt: skip

    check("world", None, list(range(info.world_size)))
    for name in mesh.names:
        sub = mesh[name]
        check(name, sub.get_group(), sub.mesh.flatten().tolist())
    for name in ("ep", "cp"):  # the axes whose traffic is all-to-all
        if name in mesh.names and mesh[name].size() > 1:
            exchange(name, mesh[name].get_group(), mesh[name].mesh.flatten().tolist())

    failed = torch.tensor([sum(not c["ok"] for c in checks)], device=info.device)
    tdist.all_reduce(failed)
    n_failed = int(failed.item())
    for c in checks:
        log.info(
            "%s over %-12s size %d: %s (%.1f ms)",
            c.get("kind", "all-reduce"),
            c["name"],
            len(c["members"]),
            "ok" if c["ok"] else f"FAILED got {c['got']} want {c['want']}",
            c["ms"],
        )
    if args.report_dir is not None:
        args.report_dir.mkdir(parents=True, exist_ok=True)
        report = {
            "rank": rank,
            "host": socket.gethostname(),
            "node": node,  # this host's index among the job's hosts, in the order of their first rank
            "world_size": info.world_size,
            "local_rank": info.local_rank,
            "local_world_size": info.local_world_size,
            "num_nodes": info.num_nodes,
            "launcher": info.launcher,
            "device": str(info.device),
            "backend": info.backend,
            "degrees": mesh.dims.degrees,
            "coordinates": {k: list(v) for k, v in mesh.coordinates().items()},
            "coordinate_line": mesh.describe(rank),
            "groups": {c["name"]: c["members"] for c in checks},
            "checks": checks,
            "env_master": [mmm_env.get("MASTER_ADDR"), mmm_env.get("MASTER_PORT")],
        }
        (args.report_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if n_failed:
        log.error("smoke test FAILED: %d check(s) failed across ranks", n_failed)
        return 1
    log.info("smoke test passed: %d all-reduce checks on each of %d ranks", len(checks), info.world_size)
    return 0


if __name__ == "__main__":
    from mmm.dist import run_main

    run_main(main, prog="python -m mmm")
