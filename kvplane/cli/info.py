"""``kvplane info``: the report a user pastes into a bug, as ``vllm collect-env`` is.

Versions (kvplane, torch, vLLM, the transfer engines, device packages), drivers and toolkits (``system.py``),
installed backends (and why each unavailable one declined), the selected backend, which transfer engines
import, NICs and RDMA devices, the environment kvplane and the engines read (secrets redacted), and the
side-channel ports a connector config would use (``sidechannel.py``). An invalid ``$KVPLANE_DEVICE`` is an
error: ``main`` prints the report and exits non-zero with the valid devices named.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from typing import Any

from kvplane import __version__
from kvplane.backend.registry import ENV_VAR, default_registry
from kvplane.cli import sidechannel, system
from kvplane.errors import KvplaneError

# module to import -> distributions that may provide it (first installed wins)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mooncake": ("mooncake.engine", ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")),
    "nixl": ("nixl_cu12", ("nixl-cu12",)),
    "nixl-cu13": ("nixl_cu13", ("nixl-cu13",)),
}


def engine_status() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for engine, (module, dists) in ENGINES.items():
        dist, version = system.first_installed(dists)
        if dist is None:
            out[engine] = {"importable": False, "reason": f"not installed (pip install {dists[0]})"}
            continue
        try:
            importlib.import_module(module)
            out[engine] = {"importable": True, "distribution": dist, "version": version}
        except Exception as e:  # an installed engine that fails to load says why (missing libibverbs...)
            out[engine] = {"importable": False, "distribution": dist, "version": version, "reason": str(e)}
    return out


def _backends() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    registry = default_registry()
    backends = []
    for st in registry.survey():
        entry: dict[str, Any] = {"name": st.name, "available": st.probe.available, "emulated": st.emulated}
        entry["reason"] = st.probe.reason
        if st.cls is not None:
            entry["torch_device_type"] = st.cls.torch_device_type
            entry["collective_backend"] = st.cls.collective_backend
            entry["mooncake_protocol"] = st.cls.mooncake_protocol
            entry["nixl_memory_type"] = st.cls.nixl_memory_type
        backends.append(entry)
    try:
        selected: dict[str, Any] = {"name": registry.select().name}
    except KvplaneError as e:
        selected = {"name": None, "error": str(e)}
    return backends, selected


def collect(config: str | None = None, tp_size: int = 1, dp_size: int = 1, role: str | None = None) -> dict[str, Any]:
    import torch

    backends, selected = _backends()
    return {
        "kvplane": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "os": system.kernel(),
        "env": {ENV_VAR: os.environ.get(ENV_VAR)},
        "packages": system.versions(),
        "drivers": system.drivers(),
        "backends": backends,
        "selected": selected,
        "engines": engine_status(),
        "nics": system.nics(),
        "rdma_devices": system.rdma_devices(),
        "environment": system.environment(),
        "side_channel": sidechannel.report(config, tp_size, dp_size, role=role),
    }


def render(info: dict[str, Any]) -> str:
    lines = [f"kvplane {info['kvplane']}  torch {info['torch']} (cuda {info['torch_cuda']})  "
             f"python {info['python']}  {info['os']}", "packages:"]
    lines += [f"  {name:<26} {version}" for name, version in info["packages"].items()]
    lines.append("drivers and toolkits:")
    lines += [f"  {name:<26} {value}" for name, value in info["drivers"].items()]
    lines.append("backends:")
    for b in info["backends"]:
        state = "available" + (" (emulated)" if b["emulated"] else "") if b["available"] else "unavailable"
        detail = f" - {b['reason']}" if b["reason"] else ""
        lines.append(f"  {b['name']:<6} {state}{detail}")
    sel = info["selected"]
    env = info["env"][ENV_VAR]
    lines.append(f"selected: {sel['name']}" + (f" ({ENV_VAR}={env})" if env else " (auto)"))
    if sel.get("error"):
        lines.append(f"  error: {sel['error']}")
    lines.append("transfer engines:")
    for name, e in info["engines"].items():
        if e["importable"]:
            lines.append(f"  {name:<10} {e['distribution']} {e['version']}")
        else:
            lines.append(f"  {name:<10} not usable - {e['reason']}")
    lines.append("NICs (/sys/class/net):" if info["nics"] else "NICs: none seen (/sys/class/net)")
    lines += [f"  {n['name']:<12} {n['state']:<8} mtu {n['mtu'] or '?'} {' '.join(n['addresses'])}".rstrip()
              for n in info["nics"]]
    lines.append("RDMA devices (/sys/class/infiniband):" if info["rdma_devices"] else
                 "RDMA devices: none seen (/sys/class/infiniband)")
    lines += [f"  {d['name']:<12} " + ", ".join(f"port {p['port']} {p['state']} {p['link_layer']}" for p in d["ports"])
              for d in info["rdma_devices"]]
    watched = ", ".join([f"{p}*" for p in system.ENV_PREFIXES] + list(system.ENV_NAMES))
    lines.append("environment:" if info["environment"] else f"environment: none of {watched} set")
    lines += [f"  {k}={v}" for k, v in info["environment"].items()]
    lines += sidechannel.render(info["side_channel"])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--config", metavar="PATH|JSON",
                        help="kv_connector_extra_config (or a --kv-transfer-config) whose side-channel ports to show")
    parser.add_argument("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel size (default 1)")
    parser.add_argument("--dp", type=_positive, default=1, metavar="N",
                        help="data-parallel ranks on this host (default 1)")
    parser.add_argument("--role", choices=sorted(sidechannel.SIDES),
                        help="which side's authentication to check (default: the config's kv_role, else both)")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def run(args: argparse.Namespace) -> int:
    """Print the report; 2 when ``$KVPLANE_DEVICE`` names no usable backend (the report says which are), or when
    the ``--config`` given would stop a side from starting (the report says why)."""
    data = collect(args.config, args.tp, args.dp, args.role)
    print(json.dumps(data, indent=2) if args.json else render(data))
    if os.environ.get(ENV_VAR) and data["selected"]["name"] is None:
        print(f"kvplane: error: {data['selected']['error']}", file=sys.stderr)
        return 2
    if args.config and "error" in data["side_channel"]:
        print(f"kvplane: error: --config would not start: {data['side_channel']['error']}", file=sys.stderr)
        return 2
    return 0
