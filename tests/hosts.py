"""Several hosts on one machine: Linux network namespaces joined by a bridge, each with its own address
and hostname, for multi-node tests (and for anyone who wants to try a multi-node launch on a laptop).

    sudo scripts/hosts up 2                # node1 10.213.<id>.1, node2 10.213.<id>.2 (prints them)
    sudo scripts/hosts run node2 hostname  # -> node2
    sudo scripts/hosts agent               # the path of a remote-shell agent (for mpiexec)
    sudo scripts/hosts down                # removes its namespaces, veths, bridge, state (--id N, --all)

In Python (the tests):

    with Hosts.up(2) as hosts:
        hosts.run("node1", ["hostname"])       # a subprocess.CompletedProcess
        hosts.popen("node2", cmd)              # a running process on node2
        hosts.hostfile(slots=2)                # "node1 slots=2\\nnode2 slots=2\\n" written to a file

A *host* is a network namespace (its own interfaces and loopback, one veth whose other end is on the
bridge) plus, for every command run on it, a UTS namespace (its hostname) and a mount namespace in
which ``/etc/hosts`` names every host of the cluster, and a node-local temporary folder (``TMPDIR``,
what Python's tempfile and most tools use; ``/tmp`` itself stays shared because a checkout or a virtual
environment may live there). Everything else (this project's tree, the virtual environment, home) is shared, as a
cluster's shared filesystem is. Traffic goes only to the cluster's private /24 (which exists only
inside these namespaces and on the bridge) and to loopback.

Each cluster has an id (its subnet ``10.213.<id>.0/24``, its names ``mmm<id>-...``) and a state
folder under ``/run/mmm-hosts/<id>`` that records the process that made it; a cluster whose maker has
died is stale and is removed by the next ``up`` (a crashed test leaves nothing behind for long).
Needs root, ``ip`` (iproute2), ``unshare`` and ``mount``: :func:`missing_requirements` says which is
missing, so tests can skip saying why.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

STATE = Path("/run/mmm-hosts")
SUBNET = "10.213.{id}.0/24"
BRIDGE = "mmm{id}br"
MAX_HOSTS = 200


class HostsUnavailable(RuntimeError):
    """This machine cannot make the hosts (not root, no ``ip``/``unshare``, no netns support)."""


def missing_requirements() -> str | None:
    """Why this machine cannot make the hosts, or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces); run the tests as root"
    for tool in ("ip", "unshare", "mount", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2 / util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HostsUnavailable(f"`{shlex.join(cmd)}` failed: {p.stderr.strip()}")
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Hosts:
    """A running cluster of ``n`` hosts named ``node1..nodeN``."""

    id: int
    n: int

    # ------------------------------------------------------------------ names
    @property
    def state(self) -> Path:
        return STATE / str(self.id)

    @property
    def bridge(self) -> str:
        return BRIDGE.format(id=self.id)

    @property
    def bridge_address(self) -> str:
        """The root namespace's address on the cluster's network (for a daemon outside the hosts)."""
        return f"10.213.{self.id}.254"

    @property
    def names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.n + 1)]

    def address(self, host: str) -> str:
        return f"10.213.{self.id}.{self._index(host)}"

    def netns(self, host: str) -> str:
        return f"mmm{self.id}-{host}"

    def tmp(self, host: str) -> Path:
        """The host's node-local temporary folder (its ``TMPDIR``)."""
        return self.state / "tmp" / host

    @property
    def local(self) -> Path:
        """A node-local disk: one path, a folder of each host's own behind it (a bind mount in the host's
        mount namespace), as ``/local/scratch`` is on a cluster's nodes."""
        return self.state / "local"

    def _index(self, host: str) -> int:
        if host not in self.names:
            raise ValueError(f"no host {host!r} in this cluster; hosts: {', '.join(self.names)}")
        return self.names.index(host) + 1

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def up(cls, n: int, *, id: int | None = None) -> Hosts:
        """Make ``n`` hosts (removing stale clusters first). Raises :class:`HostsUnavailable`."""
        why = missing_requirements()
        if why:
            raise HostsUnavailable(why)
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"n={n}: between 1 and {MAX_HOSTS} hosts")
        remove_stale()
        STATE.mkdir(parents=True, exist_ok=True)
        if id is None:
            used = {int(p.name) for p in STATE.iterdir() if p.name.isdigit()}
            id = next(i for i in range(1, 250) if i not in used)
        hosts = cls(id, n)
        hosts.state.mkdir(parents=True, exist_ok=False)
        (hosts.state / "owner").write_text(str(os.getpid()))
        (hosts.state / "n").write_text(str(n))
        try:
            hosts._make()
        except BaseException:
            hosts.down()
            raise
        return hosts

    def _make(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{self.address(h)} {h}" for h in self.names]
        # c10d's store listens on both stacks and looks up its clients as IPv4-mapped IPv6 addresses
        lines += [f"::ffff:{self.address(h)} {h}" for h in self.names]
        (self.state / "etc-hosts").write_text("\n".join(lines) + "\n")
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.names:
            ns, i = self.netns(h), self._index(h)
            outer, inner = f"mmm{self.id}v{i}", f"mmm{self.id}p{i}"
            self.tmp(h).mkdir(parents=True, exist_ok=True)
            self.tmp(h).chmod(0o1777)
            (self.state / "local-disks" / h).mkdir(parents=True, exist_ok=True)
            self.local.mkdir(exist_ok=True)
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", inner, "name", "eth0", netns=ns)
            _ip("addr", "add", f"{self.address(h)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)

    def down(self) -> None:
        """Remove every namespace, veth and the bridge of this cluster, and its state. Idempotent."""
        _remove(self.id)

    def lose(self, host: str) -> list[int]:
        """``host`` is lost, as when it crashes: its link goes down and every process on it is killed
        (SIGKILL); the processes' pids."""
        _ip("link", "set", f"mmm{self.id}v{self._index(host)}", "down")
        pids = [int(x) for x in _ip("netns", "pids", self.netns(host)).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        return pids

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # ------------------------------------------------------------------ running things on a host
    def command(self, host: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on ``host``: in its network namespace, with its hostname, ``/etc/hosts`` and
        node-local temporary folder (``TMPDIR``; ``/tmp`` itself stays shared, since the project or its
        virtual environment may live there)."""
        setup = (
            f"hostname {host} && mount --bind {shlex.quote(str(self.state / 'etc-hosts'))} /etc/hosts && "
            f"mount --bind {shlex.quote(str(self.state / 'local-disks' / host))} {shlex.quote(str(self.local))} && "
            f'TMPDIR={shlex.quote(str(self.tmp(host)))} exec "$@"'
        )
        return [
            "nsenter", f"--net=/run/netns/{self.netns(host)}",  # not `ip netns exec`: it remounts /sys
            "unshare", "--uts", "--mount", "--propagation", "private",
            "sh", "-c", setup, "sh", *cmd,
        ]  # fmt: skip

    def run(self, host: str, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(host, cmd), **kw)

    def popen(self, host: str, cmd: Sequence[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, cmd), **kw)

    def hostfile(self, path: Path, *, slots: int, hosts: Sequence[str] | None = None) -> Path:
        """An MPI hostfile (``host slots=N`` per line) naming ``hosts`` (default: all)."""
        path.write_text("".join(f"{h} slots={slots}\n" for h in hosts or self.names))
        return path

    def agent(self) -> Path:
        """A remote-shell agent, ``AGENT [ssh options] HOST CMD...``, that runs CMD (a shell command
        line, as ssh sends it) on HOST of this cluster: give it to mpiexec in place of ssh."""
        path = self.state / "agent"
        if not path.exists():
            path.write_text(
                f"#!/bin/sh\n# ssh for the hosts of cluster {self.id}: {Path(__file__).resolve()} run HOST CMD\n"
                f"exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
                f'agent-run {self.id} "$@"\n'
            )
            path.chmod(0o755)
        return path


def _ssh_split(argv: Sequence[str]) -> tuple[str, str]:
    """HOST and the command line from an ssh-style argument list (options before the host ignored)."""
    args = list(argv)
    with_value = {"-p", "-l", "-o", "-i", "-F", "-E", "-J", "-b", "-c", "-m", "-S", "-W", "-w"}
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        if opt in with_value and args:
            args.pop(0)
    if not args:
        raise SystemExit("hosts agent: no host given")
    host = args.pop(0).split("@")[-1]
    return host, " ".join(args)


def clusters() -> Iterator[Hosts]:
    if not STATE.is_dir():
        return
    for p in sorted(STATE.iterdir()):
        if p.name.isdigit():
            try:
                n = int((p / "n").read_text())
            except (OSError, ValueError):
                n = 0
            yield Hosts(int(p.name), n)


def _owner(id: int) -> int | None:
    try:
        return int((STATE / str(id) / "owner").read_text())
    except (OSError, ValueError):
        return None


def remove_stale() -> list[int]:
    """Remove clusters whose maker has died (a crashed test); their ids."""
    gone = []
    for c in list(clusters()):
        owner = _owner(c.id)
        if owner is None or not _alive(owner):
            _remove(c.id)
            gone.append(c.id)
    return gone


def _remove(id: int) -> None:
    prefix = f"mmm{id}-"
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(prefix):
            # whatever still runs on the host goes with it (a remote daemon's orphans, a rank left behind)
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)  # its end of each veth goes with it
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"mmm{id}v") or name == BRIDGE.format(id=id):
            _ip("link", "del", name, check=False)
    shutil.rmtree(STATE / str(id), ignore_errors=True)


# ---------------------------------------------------------------------- command line
def _find(id: int | None) -> Hosts:
    up = list(clusters())
    found = [c for c in up if id is None or c.id == id]
    if not found and up:
        raise SystemExit(f"hosts: cluster {id} is not up (up: {[c.id for c in up]})")
    if not found:
        raise SystemExit("hosts: no cluster is up; `scripts/hosts up 2` makes one")
    if len(found) > 1:
        raise SystemExit(f"hosts: {len(found)} clusters are up; choose one with --id ({[c.id for c in found]})")
    return found[0]


def agent_run(id: int, argv: Sequence[str]) -> int:
    """What mpiexec asked "ssh" to do (``[ssh options] HOST CMD...``), done on that host of cluster ``id``."""
    host, line = _ssh_split(argv)
    return subprocess.call(_find(id).command(host, ["sh", "-c", line]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["agent-run"]:  # ssh's own options (-x, -o ...) follow: no argparse here
        return agent_run(int(argv[1]), argv[2:])
    p = argparse.ArgumentParser(
        prog="scripts/hosts",
        description="Several hosts on this machine (network namespaces with their own address and hostname), "
        "for trying multi-node launches. Needs root.",
    )
    p.add_argument("--id", type=int, default=None, help="which cluster (default: the only one up)")
    sub = p.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make N hosts node1..nodeN (and keep them until `down`)")
    up.add_argument("n", type=int)
    down = sub.add_parser("down", help="remove the cluster (the only one up, or --id's; --all: every one)")
    down.add_argument("--all", action="store_true", help="every cluster up (the test suite's too)")
    sub.add_parser("status", help="list the clusters and their hosts")
    sub.add_parser("agent", help="print the path of the remote-shell agent for mpiexec")
    r = sub.add_parser("run", help="run a command on a host: run HOST CMD...")
    r.add_argument("host")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        if args.what == "up":
            hosts = Hosts.up(args.n, id=args.id)
            (hosts.state / "owner").write_text("1")  # kept until `down` (pid 1 never dies)
            for h in hosts.names:
                print(f"{h} {hosts.address(h)}")
            return 0
        if args.what == "down":
            if args.all and args.id is not None:
                raise SystemExit(f"hosts: down --all removes every cluster; --id {args.id} names one: give one of them")
            if args.all:
                for c in list(clusters()):
                    c.down()
            elif args.id is not None or list(clusters()):  # none up: nothing to do
                _find(args.id).down()  # several up and no --id: one line naming them (another's may be running)
            return 0
        if args.what == "status":
            for c in clusters():
                print(f"cluster {c.id}: {', '.join(f'{h} {c.address(h)}' for h in c.names)} (owner pid {_owner(c.id)})")
            return 0
        hosts = _find(args.id)
        if args.what == "agent":
            print(hosts.agent())
            return 0
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd  # run
        return subprocess.call(hosts.command(args.host, cmd))
    except (HostsUnavailable, ValueError) as e:
        print(f"hosts: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
