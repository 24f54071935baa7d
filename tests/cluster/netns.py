"""Hosts with network stacks of their own: Linux network namespaces joined by veth pairs to a bridge.

``Hosts(n)`` makes a hub namespace holding a bridge, and ``n`` host
namespaces, each with one veth pair to the bridge (``eth0`` inside, at
``10.<a>.<b>.<k + 2>/24``) and its own loopback. Nothing is routed
anywhere else: the only addresses a host can reach are the other hosts'.
:meth:`Hosts.cut` sets a host's link down at the bridge (a partition: both
sides stay alive and keep their sockets) and :meth:`Hosts.heal` sets it up
again. :meth:`Hosts.close` kills every process left in the namespaces and
deletes them (the links and the bridge go with them); it runs even when the
test failed, and ``sweep`` removes what an earlier run that was killed
left behind.

Needs root (``CAP_NET_ADMIN``) and iproute2; :func:`unavailable` says why
not, for a skip.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["PREFIX", "Hosts", "sweep", "unavailable"]

#: Every namespace these tests make starts with it (so a sweep finds what a killed run left).
PREFIX = "actns"
#: The Ray head's port, in the first namespace.
RAY_PORT = 6379
_QUIET: dict[str, Any] = {"check": True, "capture_output": True, "timeout": 120}
#: Ray's start without token authentication (the cluster lives in namespaces of this machine only).
_NO_TOKEN = dict(os.environ, RAY_AUTH_MODE="disabled")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def pids_in(namespace: str) -> list[int]:
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split()]


def _kill_all(namespace: str) -> None:
    for _ in range(50):
        pids = pids_in(namespace)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)  # a teardown guard: processes the kernel has not reaped yet


def sweep() -> None:
    """Remove every namespace of these tests (and what runs in it) that a killed run left."""
    for namespace in namespaces():
        _kill_all(namespace)
        _ip("netns", "del", namespace, check=False)


class Hosts:
    """``n`` network namespaces on one bridge; a context manager that removes them all."""

    def __init__(self, n: int) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.hub = f"{PREFIX}{tag}h"
        self.names = [f"{PREFIX}{tag}n{k}" for k in range(n)]
        a, b = random.randrange(100, 250), random.randrange(1, 250)
        self.addresses = [f"10.{a}.{b}.{k + 2}" for k in range(n)]
        self._ends = [f"an{tag}p{k}" for k in range(n)]  # the bridge-side end of each host's link
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for name, address, end in zip(self.names, self.addresses, self._ends, strict=True):
            _ip("netns", "add", name)
            _ip("link", "add", end, "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", self.hub, "link", "set", end, "master", "br0")
            _ip("-n", self.hub, "link", "set", end, "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def spec(self) -> dict[str, object]:
        """What a process in one of the namespaces needs to reach, cut and heal the others."""
        return {"names": self.names, "addresses": self.addresses, "hub": self.hub, "ends": self._ends}

    def start_ray(self, cpus: int = 1) -> str:
        """A Ray cluster: the head in the first namespace, one node in each other; returns its address."""
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        common = [f"--num-cpus={cpus}", "--disable-usage-stats"]
        address = f"{self.addresses[0]}:{RAY_PORT}"
        head = [ray, "start", "--head", f"--node-ip-address={self.addresses[0]}", f"--port={RAY_PORT}"]
        # (no token: a ~/.ray/auth_token left by an earlier local Ray turned it on for the head, and the nodes
        # in the other namespaces were refused)
        subprocess.run(self.run_in(0, [*head, "--include-dashboard=false", *common]), env=_NO_TOKEN, **_QUIET)
        for k in range(1, len(self.names)):
            node = [ray, "start", f"--address={address}", f"--node-ip-address={self.addresses[k]}", *common]
            self._join(k, node)
        return address

    def _join(self, k: int, node: list[str]) -> None:
        """Start host ``k``'s Ray node; one that fails says why (``ray start``'s own output)."""
        done = subprocess.run(
            self.run_in(k, node), capture_output=True, text=True, timeout=120, check=False, env=_NO_TOKEN
        )
        if done.returncode != 0:
            raise RuntimeError(f"ray start on {self.names[k]} failed: {(done.stdout + done.stderr)[-3000:]}")

    def run_in(self, k: int, command: list[str]) -> list[str]:
        """``command`` prefixed to run in host ``k``'s namespace."""
        return ["ip", "netns", "exec", self.names[k], *command]

    def cut(self, k: int) -> None:
        """Partition host ``k``: its link goes down at the bridge; its processes live on."""
        _ip("-n", self.hub, "link", "set", self._ends[k], "down")

    def heal(self, k: int) -> None:
        _ip("-n", self.hub, "link", "set", self._ends[k], "up")

    def close(self) -> None:
        for name in [*self.names, self.hub]:
            _kill_all(name)
            _ip("netns", "del", name, check=False)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    """``python netns.py [--hosts N] -- COMMAND...``: run COMMAND in the first of N namespaces, Ray started."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.hosts < 1:
        parser.error(f"--hosts must be at least 1, not {args.hosts}")
    if not command:
        parser.error("give the command to run in the first namespace after --")
    sweep()
    with Hosts(args.hosts) as hosts:
        address = hosts.start_ray()
        env = dict(os.environ, RAY_ADDRESS=address)
        code = subprocess.run(hosts.run_in(0, command), env=env).returncode
    sys.exit(code)


if __name__ == "__main__":
    main()
