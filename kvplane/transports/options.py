"""What the transfer engines accept as options: Mooncake protocols and NICs, NIXL backends. Read by configs.

Neither engine checks these itself: Mooncake's ``initialize`` returns 0 for a protocol it does not know (seen
with mooncake-transfer-engine 0.3.13 here) and fails later at the first transfer, and ``nixl_agent`` skips a
backend whose plugin is missing with a log line. So ``DisaggConfig`` checks them here, when it is built.

- Mooncake protocols: the names ``MultiTransport::installTransport`` (Mooncake's ``multi_transport.cpp``)
  knows; which ones a given wheel has depends on its build flags (``USE_ASCEND_DIRECT``, ``USE_EFA`` ...).
- Mooncake ``device_name``: a comma-separated list of RDMA NIC names (``mlx5_0,mlx5_1``), as under
  ``/sys/class/infiniband``; "" lets Mooncake discover them. Where that directory lists devices, every name
  must be one of them.
- NIXL backends: the plugins the installed NIXL ships (``libplugin_<NAME>.so`` next to its package, or in
  ``$NIXL_PLUGIN_DIR``), the names ``nixl_agent.get_plugin_list()`` returns.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

MOONCAKE_PROTOCOLS: tuple[str, ...] = (
    "tcp", "rdma", "rdma_twosided", "efa", "barex", "ascend", "nvlink", "nvlink_intra", "hip", "maca", "musa",
    "cxl", "shm", "ubshmem", "ub", "nvmeof", "nccl", "flagcx", "cxi", "sunrise_link",
)
RDMA_PROTOCOLS = ("rdma", "rdma_twosided", "efa", "barex")  # the ones device_name selects NICs for
NIXL_MODULES = ("nixl_cu12", "nixl_cu13")
NIXL_DEFAULT_BACKENDS: tuple[str, ...] = ("UCX",)
SYS_INFINIBAND = Path("/sys/class/infiniband")
_NIC = re.compile(r"^[A-Za-z0-9_.:-]+$")
_PLUGIN = re.compile(r"^libplugin_(?P<name>[A-Za-z0-9_]+)\.so$")


def rdma_devices(root: Path = SYS_INFINIBAND) -> list[str]:
    """The RDMA devices the kernel lists (``mlx5_0``...); empty where there are none or no sysfs."""
    try:
        return sorted(p.name for p in root.iterdir())
    except OSError:
        return []


def nic_problem(device_name: str, protocol: str, available: list[str]) -> str:
    """Why ``device_name`` cannot be Mooncake's NIC list for ``protocol`` ("" when it can)."""
    if not device_name:
        return ""
    names = device_name.split(",")
    bad = [n for n in names if not _NIC.match(n)]
    if bad:
        return f"holds {bad}, not NIC names; give a comma-separated list such as 'mlx5_0,mlx5_1' (or '')"
    if protocol not in RDMA_PROTOCOLS:
        return (f"names NICs, but protocol {protocol!r} takes none (only {list(RDMA_PROTOCOLS)} do); "
                f"remove device_name or choose an RDMA protocol")
    missing = [n for n in names if n not in available]
    if available and missing:
        return f"names {missing}, which this machine does not have; choose from {available} (/sys/class/infiniband)"
    return ""


def nixl_plugin_dirs() -> list[Path]:
    """Where the installed NIXL keeps its backend plugins ($NIXL_PLUGIN_DIR first), without importing it."""
    dirs = [Path(os.environ["NIXL_PLUGIN_DIR"])] if os.environ.get("NIXL_PLUGIN_DIR") else []
    for module in NIXL_MODULES:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        package = Path(next(iter(spec.submodule_search_locations)))
        dirs.append(package.parent / f"{module}.libs" / "nixl")
    return dirs


def nixl_backends(dirs: list[Path] | None = None) -> list[str]:
    """The backend plugins the installed NIXL ships (``UCX``, ``LIBFABRIC``...); empty without NIXL."""
    found: set[str] = set()
    for directory in nixl_plugin_dirs() if dirs is None else dirs:
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        found.update(m["name"] for e in entries if (m := _PLUGIN.match(e.name)))
    return sorted(found)


@functools.cache
def installed_nixl_backends() -> tuple[str, ...]:
    """``nixl_backends()`` of this process's NIXL, looked up once."""
    return tuple(nixl_backends())
