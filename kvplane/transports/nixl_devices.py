"""Which network devices a NIXL agent's UCX may use: those that keep its listeners on ``host``.

UCX's TCP transport opens one listening socket on the address of every network device it uses (never a wildcard),
and by default it uses every device with an address: loopback, the fabric NIC, a management or container bridge.
So an agent advertising 10.0.0.7 also listened on 127.0.0.1 and on every other address of the host (seen with
nixl-cu12 1.5.1 in a network namespace: ``tests/netns/test_engine_listeners.py``). ``UCX_NET_DEVICES`` names the
devices UCX may use; kvplane sets it while an agent starts, unless it is already set (yours wins):

- ``host`` loopback: ``lo`` (same-host peers; UCX on lo moves data by cma, a single copy);
- ``host`` an address of one of this machine's interfaces: that interface, plus every RDMA port the kernel lists
  (``mlx5_0:1``), so UCX keeps its RDMA transports (which open no TCP listener);
- otherwise (a name, or an address no interface here holds, as behind NAT or a proxy): nothing, UCX picks.

Addresses come from ``getifaddrs(3)`` through ctypes (psutil is not a dependency of kvplane).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import socket
from pathlib import Path

from kvplane.hosts import is_loopback
from kvplane.transports.options import SYS_INFINIBAND

NET_DEVICES_ENV = "UCX_NET_DEVICES"
LOOPBACK_ENV = {NET_DEVICES_ENV: "lo"}
logger = logging.getLogger("kvplane.transports")


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
    ("ifa_data", ctypes.c_void_p),
]


def _address(sa: _Sockaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a ``struct sockaddr`` holds (sockaddr_in: 4 bytes after the port; sockaddr_in6: 16 after
    the port and flow info), or None for another family."""
    raw = ctypes.string_at(ctypes.addressof(sa), 28 if sa.sa_family == socket.AF_INET6 else 16)
    if sa.sa_family == socket.AF_INET:
        return ipaddress.IPv4Address(raw[4:8])
    if sa.sa_family == socket.AF_INET6:
        return ipaddress.IPv6Address(raw[8:24])
    return None


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """``(interface, address)`` for every IP address of this machine (network namespace); empty where
    ``getifaddrs`` is not there or fails."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError):
        return []
    head = ctypes.POINTER(_Ifaddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    out = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr and entry.ifa_name:
                addr = _address(entry.ifa_addr.contents)
                if addr is not None:
                    # a labelled secondary address ("eth0:1") belongs to the device before the colon
                    out.append((entry.ifa_name.decode(errors="replace").split(":")[0], addr))
            node = entry.ifa_next
    finally:
        freeifaddrs(head)
    return out


def interface_of(host: str) -> str | None:
    """The interface that holds the address ``host``, or None (a name, or an address no interface here holds)."""
    try:
        wanted = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    for device, addr in interface_addresses():
        if addr == wanted:
            return device
    return None


def rdma_ports(root: Path = SYS_INFINIBAND) -> list[str]:
    """UCX's names for the RDMA ports the kernel lists (``mlx5_0:1``); empty where there are none."""
    try:
        return sorted(f"{dev.name}:{port.name}" for dev in root.iterdir() for port in (dev / "ports").iterdir())
    except OSError:
        return []


def net_devices_env(host: str) -> dict[str, str]:
    """The ``UCX_NET_DEVICES`` that keeps an agent advertising ``host`` listening on ``host`` only (module doc);
    empty when kvplane should leave UCX to choose."""
    if is_loopback(host):
        return dict(LOOPBACK_ENV)
    device = interface_of(host)
    if device is None:
        logger.debug("NIXL: no interface here holds %r; UCX may listen on every device (set $%s to choose)",
                     host, NET_DEVICES_ENV)
        return {}
    return {NET_DEVICES_ENV: ",".join([device, *rdma_ports()])}
