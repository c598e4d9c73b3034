"""The one owner of mesh topology: degrees, validation, the DeviceMesh and its named views.

Axis order, outermost to innermost: ``pp, dp_replicate, dp_shard, cp, tp``. TP is
innermost so that its ranks are neighbours (one node) under any launcher that places
consecutive ranks together. Flattened views built once and kept:

- ``dp``          = dp_replicate x dp_shard  (data parallel: batch split, gradient reduce)
- ``dp_shard_cp`` = dp_shard x cp            (what FSDP shards parameters over when CP is on)
- ``dp_cp``       = dp_replicate x dp_shard x cp  (loss / gradient averaging group)

Only axes of degree > 1 become mesh dimensions; ``mesh.get("tp")`` is None when tp is off
and ``mesh["tp"]`` says so in its error. A world of one gets a 1-D mesh of size one.

Expert parallel (``ep``) is not an axis of its own: it borrows its ranks from ``dp_shard x cp``, the
ranks that hold different tokens of the same model (as torchtitan does), so turning it on changes no
other degree. That group is cut into ``efsdp x ep`` (ep innermost: an expert group's ranks are
neighbours): the routed experts are split over ``ep`` and sharded by FSDP over ``efsdp``, what
remains of it. Views ``ep`` and ``efsdp`` (kept at size 1 too, for FSDP's sake) exist when ep > 1.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmm import dist as mdist
from mmm.dist import data_seed
from mmm.errors import UsageError
from mmm.log import get_logger

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
EP_VIEWS = ("ep", "efsdp")
EXPERT_VIEWS = (*EP_VIEWS, "ep_etp")  # ep_etp: (ep, tp) for experts split over both
AXIS_TITLES = {
    "ep": "expert parallel",
    "pp": "pipeline parallel",
    "dp_replicate": "data parallel (replicate)",
    "dp_shard": "data parallel (shard)",
    "cp": "context parallel",
    "tp": "tensor parallel",
}

log = get_logger("mesh")


class MeshError(UsageError):
    """Degrees that do not fit the world size; the message lists every problem found."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_degrees(world_size: int, *, experts: int | None = None, **degrees: int) -> tuple[dict[str, int], list[str]]:
    """Validate mesh degrees against a world size without touching torch (``experts``: a mixture's expert
    count, which the ep degrees named as valid must split too).

    Returns ``(resolved, problems)``: ``resolved`` has the one ``-1`` replaced by the
    inferred degree (when possible); ``problems`` lists every violation, each naming
    the values and a fix. Unknown names are problems too.
    """
    problems: list[str] = []
    ep = degrees.pop("ep", 1)
    unknown = sorted(set(degrees) - set(AXES))
    if unknown:
        problems.append(f"unknown mesh axis {', '.join(unknown)}; axes are {', '.join(AXES)}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        return {}, problems + [f"world size {world_size!r} must be a positive integer"]
    resolved: dict[str, int] = {}
    inferred: list[str] = []
    for axis in AXES:
        d = degrees.get(axis, 1)
        if isinstance(d, bool) or not isinstance(d, int) or (d < 1 and d != -1):
            problems.append(f"{axis}={d!r} is invalid; a degree is a positive integer, or -1 to infer it")
            continue
        if d == -1:
            inferred.append(axis)
            continue
        if world_size % d:
            valid = ", ".join(map(str, _divisors(world_size)))
            problems.append(
                f"{axis}={d} does not divide world size {world_size}; valid {axis} for {world_size} ranks: {valid}"
            )
        resolved[axis] = d
    if len(inferred) > 1:
        problems.append(f"only one degree may be -1 (inferred); got -1 for {' and '.join(inferred)}")
    fixed = [a for a in AXES if a in resolved]
    product = math.prod(resolved.values())
    if problems:
        return resolved, problems
    if inferred:
        axis = inferred[0]
        if world_size % product:
            set_ = ", ".join(f"{a}={resolved[a]}" for a in fixed if resolved[a] > 1)
            problems.append(
                f"the fixed degrees ({set_}) multiply to {product}, which does not divide world size "
                f"{world_size}, so {axis}=-1 cannot be inferred; choose degrees whose product divides {world_size}"
            )
        else:
            resolved[axis] = world_size // product
    elif product != world_size:
        expr = " x ".join(f"{a}={resolved[a]}" for a in AXES)
        problems.append(
            f"{expr} = {product} ranks, but the world size is {world_size}; "
            f"set one degree to -1 to infer it (e.g. dp_shard=-1) or launch {product} ranks"
        )
    out = {a: resolved.get(a, 1) for a in AXES}
    if not problems:
        problems += ep_problems(ep, out, experts)
    return (out | {"ep": ep} if ep != 1 else out), problems


def ep_problems(ep, degrees: dict[str, int], experts: int | None = None) -> list[str]:
    """Expert parallel borrows its ranks from dp_shard x cp (module doc); the degrees named as valid also
    split ``experts`` when given."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return [f"ep={ep!r} is invalid; the expert-parallel degree is a positive integer"]
    room = degrees["dp_shard"] * degrees["cp"]
    if room % ep:
        valid = ", ".join(str(d) for d in _divisors(room) if not experts or not experts % d)
        return [
            f"ep={ep} does not divide dp_shard x cp = {degrees['dp_shard']} x {degrees['cp']} = {room}: expert "
            f"parallel borrows its ranks from them; valid ep here{f' for {experts} experts' if experts else ''}: "
            f"{valid}"
        ]
    if ep > 1 and degrees["dp_replicate"] > 1:
        return [
            f"ep={ep} with dp_replicate={degrees['dp_replicate']} (HSDP) is not supported; use fsdp (dp_replicate=1), "
            "or ep=1 (HSDP with the experts replicated)"
        ]
    return []


@dataclass(frozen=True)
class ParallelDims:
    """Validated mesh degrees for a world size (one of them may be given as -1)."""

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallel, borrowed from dp_shard x cp (not a factor of the world size of its own)."""

    def __post_init__(self) -> None:
        resolved, problems = check_degrees(self.world_size, **{a: getattr(self, a) for a in (*AXES, "ep")})
        if problems:
            raise MeshError(f"invalid mesh for {self.world_size} ranks: " + "; ".join(problems))
        for axis, d in resolved.items():
            object.__setattr__(self, axis, d)

    # ---- derived degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        out = {a: getattr(self, a) for a in AXES}
        return out | {"ep": self.ep} if self.ep > 1 else out

    @property
    def efsdp(self) -> int:
        """What FSDP shards the routed experts over: dp_shard x cp / ep."""
        return self.dp_shard * self.cp // self.ep

    def size(self, name: str) -> int:
        if name in AXES or name in EP_VIEWS:
            return getattr(self, name)
        if name in FLAT_VIEWS:
            return math.prod(getattr(self, a) for a in FLAT_VIEWS[name])
        raise KeyError(name)

    # ---- flags
    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard, and cp when CP is on)."""
        return self.dp_shard_enabled or self.cp_enabled

    def enabled_axes(self) -> tuple[str, ...]:
        return tuple(a for a in AXES if getattr(self, a) > 1)

    def __str__(self) -> str:
        ep = f", ep={self.ep} (of dp_shard x cp)" if self.ep > 1 else ""
        return " x ".join(f"{a}={getattr(self, a)}" for a in AXES) + f"{ep} ({self.world_size} ranks)"


class Mesh:
    """A named DeviceMesh with its flattened views, degrees and this rank's coordinates.

    ``mesh["tp"]`` / ``mesh.get("tp")`` give sub-meshes (``get`` returns None for an axis
    of degree 1); ``mesh.root`` is the DeviceMesh itself; ``mesh.dims`` the degrees, also read
    as ``mesh.tp``, ``mesh.dp``, ``mesh.cp_enabled``, ...; ``mesh.coord("dp")`` this rank's index
    along an axis or view.
    """

    def __init__(self, dims: ParallelDims, root: DeviceMesh, views: dict[str, DeviceMesh]) -> None:
        self.dims = dims
        self.root = root
        self._views = views

    # ---- degrees and flags (those of ``dims``)
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp_replicate(self) -> int:
        return self.dims.dp_replicate

    @property
    def dp_shard(self) -> int:
        return self.dims.dp_shard

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def dp(self) -> int:
        """dp_replicate x dp_shard."""
        return self.dims.dp

    @property
    def degrees(self) -> dict[str, int]:
        return self.dims.degrees

    @property
    def pp_enabled(self) -> bool:
        return self.dims.pp_enabled

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dims.dp_replicate_enabled

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dims.dp_shard_enabled

    @property
    def dp_enabled(self) -> bool:
        return self.dims.dp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.dims.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.dims.tp_enabled

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def ep_enabled(self) -> bool:
        return self.dims.ep_enabled

    @property
    def fsdp_enabled(self) -> bool:
        return self.dims.fsdp_enabled

    def enabled_axes(self) -> tuple[str, ...]:
        return self.dims.enabled_axes()

    # ---- access
    @property
    def device_type(self) -> str:
        return self.root.device_type

    @property
    def names(self) -> tuple[str, ...]:
        """Every named sub-mesh this mesh has (enabled axes, then flattened views)."""
        return tuple(self._views)

    def one_rank_dp(self) -> DeviceMesh:
        """A data-parallel mesh of this rank alone (``dp_shard`` of size 1), for FSDP where dp = cp = 1:
        its mixed precision without sharding. Cut from the root beside its other axes, so FSDP can join
        it to tensor parallel's; made once (new groups: every rank calls it, the first time)."""
        one = getattr(self, "_one_rank_dp", None)
        if one is None:
            names = self.root.mesh_dim_names or ()
            if self.root.size() == 1:
                one = self.root
            else:
                split = self.root._unflatten(0, (1, self.root.size(0)), ("dp_shard", names[0]))
                mdist.hold_to_timeout(_groups(split))
                one = split["dp_shard"]
            self._one_rank_dp = one
        return one

    def get(self, name: str) -> DeviceMesh | None:
        if name not in AXES and name not in FLAT_VIEWS and name not in EXPERT_VIEWS:
            names = ", ".join(AXES + tuple(FLAT_VIEWS) + EXPERT_VIEWS)
            raise KeyError(f"unknown mesh name {name!r}; names are {names}")
        return self._views.get(name)

    def __getitem__(self, name: str) -> DeviceMesh:
        sub = self.get(name)
        if sub is None:
            raise KeyError(
                f"mesh axis {name!r} has degree 1 in {self.dims}; check mesh.{name}_enabled "
                f"or use mesh.get({name!r}), which returns None"
            )
        return sub

    def __contains__(self, name: object) -> bool:
        return name in self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self._views)

    def size(self, name: str) -> int:
        return self.dims.size(name)

    def coord(self, name: str) -> int:
        """This rank's index along an axis or flattened view (0 for an axis of degree 1)."""
        sub = self.get(name)
        return 0 if sub is None else sub.get_local_rank()

    def group(self, name: str):
        """The process group of a sub-mesh (None when the axis has degree 1, or the view has two dimensions)."""
        sub = self.get(name)
        return None if sub is None or sub.ndim > 1 else sub.get_group()

    def named_groups(self) -> dict[str, object]:
        """Every distinct process group of the mesh by name: axes first, then flattened views that span
        more than one enabled axis (a view over a single axis is that axis's group)."""
        out: dict[str, object] = {}
        seen: set[int] = set()
        for name in self._views:
            group = self.group(name)
            if group is not None and id(group) not in seen:
                seen.add(id(group))
                out[name] = group
        return out

    def seed_streams(self, seed: int) -> int:
        """After building the (identical) weights: give every data-parallel / context-parallel rank
        its own random stream (dropout masks differ across dp_cp ranks, as they would across the
        samples of one process's batch) while TP and PP peers keep the same one. Returns the seed."""
        import torch

        stream = data_seed(seed, self.coord("dp_cp"))
        torch.manual_seed(stream)  # seeds every device's generator too
        return stream

    # ---- description
    def coordinates(self) -> dict[str, tuple[int, int]]:
        """``{"pp": (index, size), "dp": ..., "cp": ..., "tp": ...}`` for this rank."""
        return {n: (self.coord(n), self.size(n)) for n in ("pp", "dp", "cp", "tp")}

    def describe(self, rank: int | None = None) -> str:
        """This rank's coordinate line: ``[host][ 3/7][pp:0/0][dp:1/1][tp:1/1]`` (index/last)."""
        import torch.distributed as dist

        world = self.dims.world_size
        rank = dist.get_rank() if rank is None else rank
        width = len(str(world - 1))
        parts = [f"[{socket.gethostname()}]", f"[{rank:>{width}}/{world - 1}]"]
        coords = self.coordinates() | ({"ep": (self.coord("ep"), self.ep)} if self.ep_enabled else {})
        for name, (idx, size) in coords.items():
            if name != "cp" or self.dims.cp_enabled:
                parts.append(f"[{name}:{idx}/{size - 1}]")
        return "".join(parts)

    def __repr__(self) -> str:
        return f"Mesh({self.dims}, device_type={self.device_type!r}, names={list(self.names)})"


def _groups(*meshes: DeviceMesh) -> list:
    """Every process group of ``meshes``' axes that this rank is in, each once."""
    found = {id(g): g for m in meshes for g in m.get_all_groups()}
    return list(found.values())


def init_mesh(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    ep: int = 1,
    device_type: str | None = None,
    log_coordinates: bool = True,
) -> Mesh:
    """Build the job's named DeviceMesh: ``pp x dp_replicate x dp_shard x cp x tp``, and ``ep`` taken
    from dp_shard x cp (module doc).

    One degree may be -1 (default: ``dp_shard``) and is inferred from the world size.
    Every violation is reported at once, before any collective, in a :class:`MeshError`
    that names the values and valid choices. Starts the process group with
    :func:`mmm.dist.setup` if nobody has. Rank 0 logs the degrees; each rank logs its
    coordinate line (visible with ``LOG_FROM_ALL_RANKS=1``).
    """
    info = mdist.info()
    dims = ParallelDims(
        world_size=info.world_size, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep
    )
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    device_type = device_type or info.device.type
    try:
        torch.device(device_type)
    except (RuntimeError, TypeError):
        raise UsageError(
            f"device_type={device_type!r} is not a torch device type; give cpu, cuda or xpu, or leave it out "
            f"(this job's: {info.device.type})"
        ) from None
    axes = dims.enabled_axes() or ("dp_shard",)
    shape = tuple(getattr(dims, a) for a in axes)
    for axis in dims.enabled_axes():
        log.info("initializing %s with size %d", AXIS_TITLES[axis], getattr(dims, axis))
    root = init_device_mesh(device_type, shape, mesh_dim_names=axes)
    views: dict[str, DeviceMesh] = {a: root[a] for a in dims.enabled_axes()}
    for view, parts in FLAT_VIEWS.items():
        on = tuple(a for a in parts if getattr(dims, a) > 1)
        if len(on) == 1:
            views[view] = views[on[0]]
        elif len(on) > 1:
            views[view] = root[on]._flatten(view)
    if dims.ep_enabled:  # the routed experts' (efsdp, ep) mesh, cut from dp_shard x cp (and tp beside it)
        log.info("initializing %s with size %d (of dp_shard x cp)", AXIS_TITLES["ep"], dims.ep)
        if dims.tp_enabled:
            on = tuple(a for a in ("dp_shard", "cp") if getattr(dims, a) > 1) + ("tp",)
            sparse = (
                root[on]
                ._flatten("dp_shard_cp_tp")
                ._unflatten(0, (dims.efsdp, dims.ep, dims.tp), EP_VIEWS[::-1] + ("etp",))
            )
            views["ep_etp"] = sparse["ep", "etp"]
        else:
            sparse = views["dp_shard_cp"]._unflatten(0, (dims.efsdp, dims.ep), EP_VIEWS[::-1])
        views["ep"], views["efsdp"] = sparse["ep"], sparse["efsdp"]
    mesh = Mesh(dims, root, views)
    mdist.hold_to_timeout(_groups(root, *views.values()))
    log.info("device mesh %s over %s: %s", "x".join(map(str, shape)), device_type, dims)
    if log_coordinates:
        log.info("%s", mesh.describe(info.rank))
    return mesh
