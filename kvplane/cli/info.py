"""``kvplane info``: versions, installed backends (and why each unavailable one declined), the selected
backend, and which transfer engines import."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
from typing import Any

from kvplane import __version__
from kvplane.backend.registry import ENV_VAR, default_registry
from kvplane.errors import KvplaneError

# module to import -> distributions that may provide it (first installed wins)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mooncake": ("mooncake.engine", ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")),
    "nixl": ("nixl_cu12", ("nixl-cu12",)),
    "nixl-cu13": ("nixl_cu13", ("nixl-cu13",)),
}


def _dist_version(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


def engine_status() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for engine, (module, dists) in ENGINES.items():
        dist, version = _dist_version(dists)
        if dist is None:
            out[engine] = {"importable": False, "reason": f"not installed (pip install {dists[0]})"}
            continue
        try:
            importlib.import_module(module)
            out[engine] = {"importable": True, "distribution": dist, "version": version}
        except Exception as e:  # an installed engine that fails to load says why (missing libibverbs...)
            out[engine] = {"importable": False, "distribution": dist, "version": version, "reason": str(e)}
    return out


def collect() -> dict[str, Any]:
    import torch

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
    return {
        "kvplane": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "env": {ENV_VAR: __import__("os").environ.get(ENV_VAR)},
        "backends": backends,
        "selected": selected,
        "engines": engine_status(),
    }


def render(info: dict[str, Any]) -> str:
    lines = [f"kvplane {info['kvplane']}  torch {info['torch']}  python {info['python']}", "backends:"]
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
    return "\n".join(lines)
