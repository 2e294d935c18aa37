"""Which addresses each transfer engine listens on when ``host`` is not loopback (docs/deploy.md, "Trust
boundary"): the engine runs in namespace ``a`` of a ``Link``, advertising ``a``'s veth address, which is not the
namespace's only address (it has ``lo`` too), and ``ss`` lists its process's listening sockets.

- NIXL: UCX's TCP transport listens on the address of every device it uses, so kvplane gives it the one device
  that holds ``host`` (``transports/nixl_devices.py``). Before, it listened on 127.0.0.1 too.
- Mooncake cannot be bound: its handshake listener and its TCP data listener bind the wildcard in its source
  (``findAvailableTcpPort``: ``INADDR_ANY``; ``TcpContext``: a dual-stack ``::``), whatever ``local_hostname``
  or ``MC_TCP_BIND_ADDRESS`` say. The test asserts that fact for the installed build, so a Mooncake that learns to
  bind shows up here (and the docs must change with it).
- Neither is fenced by kvplane's side channel: a raw Mooncake engine that knows only ``host:rpc_port`` learns a
  rank's registered regions from Mooncake's own handshake and reads and writes them (the last test).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nslink import Link, Side

pytestmark = pytest.mark.integration
PROBE = Path(__file__).parent / "listen_probe.py"
STRANGER = Path(__file__).parent / "mooncake_stranger.py"
ENGINE_ENV = ("UCX_NET_DEVICES", "UCX_TLS", "MC_TCP_BIND_ADDRESS", "MC_USE_IPV6")  # what a test run must not inherit


def listening(side: Side, engine: str, env: dict[str, str] | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the engine's process listens on, started with ``host`` = the
    side's address."""
    base = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV}
    done = subprocess.run([*side.exec_prefix(), sys.executable, str(PROBE), engine, side.addr],
                          capture_output=True, text=True, timeout=180, env={**base, "OMP_NUM_THREADS": "1",
                                                                            **(env or {})})
    lines = [line for line in done.stdout.splitlines() if line.startswith("LISTEN ")]
    assert done.returncode == 0 and lines, f"probe exited {done.returncode}: {done.stderr[-2000:]}"
    out = []
    for entry in json.loads(lines[-1].removeprefix("LISTEN ")):
        addr, _, port = entry.rpartition(":")
        out.append((addr.strip("[]"), int(port)))
    return out


def test_nixl_listens_only_on_the_address_it_advertises(link: Link) -> None:
    sockets = listening(link.a, "nixl")
    print(f"nixl, host {link.a.addr}: {sockets}")
    assert sockets, "UCX opened no TCP listener: nothing was measured"
    assert {addr for addr, _ in sockets} == {link.a.addr}, sockets


def test_nixl_keeps_the_ucx_net_devices_you_set(link: Link) -> None:
    sockets = listening(link.a, "nixl", {"UCX_NET_DEVICES": "all"})
    print(f"nixl, host {link.a.addr}, UCX_NET_DEVICES=all: {sockets}")
    assert {addr for addr, _ in sockets} == {link.a.addr, "127.0.0.1"}, sockets


def test_mooncake_listens_on_every_address_whatever_host_says(link: Link) -> None:
    """A fact of mooncake-transfer-engine 0.3.13.post1, not kvplane's choice (module doc); MC_TCP_BIND_ADDRESS
    does not change it."""
    for env in ({}, {"MC_TCP_BIND_ADDRESS": link.a.addr}):
        sockets = listening(link.a, "mooncake", env)
        print(f"mooncake, host {link.a.addr}, {env}: {sockets}")
        assert len(sockets) == 2, sockets  # the RPC / handshake listener and the TCP data listener
        assert {addr for addr, _ in sockets} <= {"0.0.0.0", "*", "::"}, sockets


def test_the_devices_kvplane_gives_ucx(tmp_path: Path) -> None:
    """No namespace needed: loopback gets lo; an address of this machine gets its interface and every RDMA port;
    an address no interface holds, or a name, gets nothing (UCX chooses)."""
    from kvplane.transports import nixl_devices

    pairs = nixl_devices.interface_addresses()
    assert ("lo", ipaddress.ip_address("127.0.0.1")) in pairs, pairs
    assert nixl_devices.net_devices_env("127.0.0.1") == {"UCX_NET_DEVICES": "lo"}
    held = {addr for _, addr in pairs}
    stranger = next(a for a in ("203.0.113.77", "198.51.100.77") if ipaddress.ip_address(a) not in held)
    assert nixl_devices.interface_of(stranger) is None
    assert nixl_devices.net_devices_env(stranger) == {}
    assert nixl_devices.net_devices_env("prefill-0.prefill.svc") == {}
    for device, addr in pairs:
        if [d for d, a in pairs if a == addr] == [device]:
            assert nixl_devices.interface_of(str(addr)) == device, (device, addr)
    for dev, ports in (("mlx5_0", ("1",)), ("mlx5_1", ("1", "2"))):
        for port in ports:
            (tmp_path / dev / "ports" / port).mkdir(parents=True)
    assert nixl_devices.rdma_ports(tmp_path) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert nixl_devices.rdma_ports(tmp_path / "absent") == []


def test_a_stranger_reads_and_writes_a_mooncake_rank_without_any_handshake(link: Link) -> None:
    """Why the engine ports need the network's fence (docs/deploy.md, "Trust boundary"): Mooncake's own handshake
    hands its segment descriptor (every registered region's address) to any engine that asks, and its data port
    serves it. A raw engine in the other namespace, told only ``host:rpc_port``, reads a kvplane rank's registered
    bytes and overwrites them; no kvplane side channel, key or token is involved. A fact of
    mooncake-transfer-engine 0.3.13.post1: a Mooncake that authenticates its peers fails this test."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MC_", "UCX_"))}, "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen([*link.a.exec_prefix(), sys.executable, str(STRANGER), "victim", link.a.addr],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=env)
    try:
        assert victim.stdout is not None and victim.stdin is not None
        name = json.loads(victim.stdout.readline())["name"]
        done = subprocess.run([*link.b.exec_prefix(), sys.executable, str(STRANGER), "stranger", link.b.addr, name],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"stranger in {link.b.netns} against {name}: {seen}")
        victim.stdin.write("\n")
        victim.stdin.flush()
        after = json.loads(victim.stdout.readline())
        assert seen["read_rc"] == 0 and seen["read"] == [0x5A], seen
        assert seen["write_rc"] == 0 and after["byte0"] == 0xEE, (seen, after)
    finally:
        victim.kill()
        victim.wait(30)
