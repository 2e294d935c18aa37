"""Two network namespaces joined by a veth pair, for the multi-host P/D tests: a ``Link`` made and deleted by
the test, with faults a cable or a network makes (link down and up, a rate cap, random loss).

Namespace ``a`` holds 10.77.N.1/24 on ``kva<N>``, namespace ``b`` 10.77.N.2/24 on ``kvb<N>``; N is unique per
link on this machine. Everything here shells out to ``ip``, ``tc`` and ``iptables`` as root. ``unavailable()``
says why links cannot be made here (not root, the kernel refuses namespaces, a tool is missing), so a test
skips with that reason. This kernel has no ``netem``: there is no delay fault here (see FACTS.md).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

_counter = itertools.count()


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable(need_iptables: bool = False) -> str:
    """Why links cannot be made here, or "" when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc") + (("iptables",) if need_iptables else ()):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-system-deps.sh installs it as root)"
    probe = f"kvp-probe-{os.getpid()}"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"the kernel refuses network namespaces: ip netns add: {done.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return ""


def _free_index() -> int:
    taken = set(_run("ip", "netns", "list").stdout.split())
    for _ in range(256):
        n = (os.getpid() + next(_counter)) % 250 + 1
        if f"kvp{n}a" not in taken:
            return n
    raise RuntimeError("no free 10.77.N.0/24 for a test link; delete stale kvp* namespaces (ip netns list)")


@dataclass
class Side:
    netns: str
    dev: str
    addr: str

    def exec_prefix(self) -> list[str]:
        """Put before a command line to run it in this namespace."""
        return ["ip", "netns", "exec", self.netns]

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.exec_prefix(), *argv, check=check)


class Link:
    """Namespaces ``a`` and ``b`` joined by a veth pair; ``close`` deletes both (and the pair with them)."""

    def __init__(self) -> None:
        n = _free_index()
        self.index = n
        self.a = Side(f"kvp{n}a", f"kva{n}", f"10.77.{n}.1")
        self.b = Side(f"kvp{n}b", f"kvb{n}", f"10.77.{n}.2")
        try:
            for side in (self.a, self.b):
                _run("ip", "netns", "add", side.netns)
            _run("ip", "link", "add", self.a.dev, "netns", self.a.netns, "type", "veth",
                 "peer", "name", self.b.dev, "netns", self.b.netns)
            for side in (self.a, self.b):
                side.run("ip", "addr", "add", f"{side.addr}/24", "dev", side.dev)
                side.run("ip", "link", "set", "lo", "up")
                side.run("ip", "link", "set", side.dev, "up")
        except Exception:
            self.close()
            raise

    def down(self) -> None:
        """Cut the cable: the far end goes down, so ``a`` sees no carrier and its packets go nowhere."""
        self.b.run("ip", "link", "set", self.b.dev, "down")

    def up(self) -> None:
        self.b.run("ip", "link", "set", self.b.dev, "up")

    def rate(self, rate: str = "1gbit") -> None:
        """A token-bucket cap on both ends (``tbf``; netem is missing from this kernel)."""
        for side in (self.a, self.b):
            side.run("tc", "qdisc", "replace", "dev", side.dev, "root", "tbf", "rate", rate, "burst", "64kb",
                     "latency", "50ms")

    def unrate(self) -> None:
        for side in (self.a, self.b):
            side.run("tc", "qdisc", "del", "dev", side.dev, "root", check=False)

    def loss(self, probability: float) -> None:
        """Drop ``probability`` of the packets arriving in each namespace (iptables ``statistic``)."""
        for side in (self.a, self.b):
            side.run("iptables", "-A", "INPUT", "-i", side.dev, "-m", "statistic", "--mode", "random",
                     "--probability", f"{probability}", "-j", "DROP")

    def netem(self, *args: str) -> str:
        """``tc qdisc ... netem`` on both ends; "" when done, else why not (this kernel has no netem)."""
        for side in (self.a, self.b):
            done = side.run("tc", "qdisc", "replace", "dev", side.dev, "root", "netem", *args, check=False)
            if done.returncode != 0:
                return f"tc netem: {done.stderr.strip()}"
        return ""

    def unreachable_address(self) -> tuple[str, str]:
        """``(address, device)`` of namespace ``b`` that ``a`` has no route to: a second veth pair, both ends in
        ``b`` (this kernel has no ``dummy`` device)."""
        addr, dev = f"10.78.{self.index}.2", f"kvx{self.index}"
        self.b.run("ip", "link", "add", dev, "type", "veth", "peer", "name", f"kvy{self.index}")
        self.b.run("ip", "addr", "add", f"{addr}/32", "dev", dev)
        for name in (dev, f"kvy{self.index}"):
            self.b.run("ip", "link", "set", name, "up")
        return addr, dev

    def join_root(self) -> tuple[str, str]:
        """A second network from the root namespace to each side, as a proxy or client host sees them:
        ``(a's address, b's address)`` on it (10.79.N.2 and 10.80.N.2; the root holds .1 of each)."""
        addrs = []
        for side, net, tag in ((self.a, 79, "a"), (self.b, 80, "b")):
            root_dev, dev = f"kvr{self.index}{tag}", f"kvs{self.index}{tag}"
            _run("ip", "link", "add", root_dev, "type", "veth", "peer", "name", dev, "netns", side.netns)
            _run("ip", "addr", "add", f"10.{net}.{self.index}.1/24", "dev", root_dev)
            _run("ip", "link", "set", root_dev, "up")
            side.run("ip", "addr", "add", f"10.{net}.{self.index}.2/24", "dev", dev)
            side.run("ip", "link", "set", dev, "up")
            addrs.append(f"10.{net}.{self.index}.2")
        return addrs[0], addrs[1]

    def close(self) -> None:
        for side in (self.a, self.b):
            _run("ip", "netns", "del", side.netns, check=False)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
