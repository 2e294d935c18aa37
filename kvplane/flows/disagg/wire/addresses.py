"""Where a P/D rank listens and what it tells peers: port arithmetic and the environment overrides.

A prefill instance's side channel has one port per rank: data-parallel rank ``d`` of an instance with TP size
``t`` and base port ``p`` owns ``p + d*t .. p + d*t + t - 1``, TP rank ``r`` listening on ``p + d*t + r`` (vLLM's
own Mooncake connector spaces DP ranks by ``tp_size`` the same way). ``kv_transfer_params.remote_port`` carries
``p + d*t``, the base of the DP rank that holds the request, and a decode rank adds the TP rank it reads from.

``host`` is the advertised address (what peers connect to, in ``kv_transfer_params.remote_host``; the transfer
engines are named by it too); ``bind_host`` is the address the side channel binds ("" = ``host``), such as
``0.0.0.0`` behind NAT or in a pod whose advertised name is a service's.

Environment overrides, in vLLM's naming style (``VLLM_NIXL_SIDE_CHANNEL_HOST``). Precedence: a variable that is
set (non-empty) wins over the config's key, which wins over the default; ``DisaggConfig(...)`` built in code
reads no environment, ``DisaggConfig.from_dict`` and the vLLM connector's config do, and an error about a field a
variable set names the variable (``blame``).

``host`` is never a wildcard (``0.0.0.0``, ``::``, ``*``): peers would connect to their own machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENV_FIELDS: dict[str, str] = {
    "KVPLANE_SIDE_CHANNEL_HOST": "host",
    "KVPLANE_SIDE_CHANNEL_BIND_HOST": "bind_host",
    "KVPLANE_SIDE_CHANNEL_PORT": "port",
    "KVPLANE_MOONCAKE_PROTOCOL": "protocol",
    "KVPLANE_MOONCAKE_DEVICE": "device_name",
    "KVPLANE_NIXL_BACKENDS": "nixl_backends",
}
WILDCARDS = ("0.0.0.0", "::", "*")  # bind-only addresses: never what a peer is told to connect to


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def dp_base_port(port: int, dp_rank: int, tp_size: int) -> int:
    """The first side-channel port of data-parallel rank ``dp_rank`` (0 when ``port`` is 0: any free port)."""
    return port + dp_rank * tp_size if port else 0


def rank_port(port: int, dp_rank: int, tp_size: int, tp_rank: int) -> int:
    """The side-channel port TP rank ``tp_rank`` of DP rank ``dp_rank`` listens on (0: any free port)."""
    return dp_base_port(port, dp_rank, tp_size) + tp_rank if port else 0


def env_overrides(env: Mapping[str, str], error: type[Exception], what: str) -> dict[str, Any]:
    """The config keys the environment sets, typed; ``error`` names a variable whose value cannot be used."""
    out: dict[str, Any] = {}
    for name, field in ENV_FIELDS.items():
        value = env.get(name, "").strip()
        if not value:
            continue
        if field == "port":
            if not value.isdigit():
                raise error(f"{what}: ${name}={value!r} is not a port number; set a base port such as 5600")
            out[field] = int(value)
        elif field == "nixl_backends":
            out[field] = [b.strip() for b in value.split(",") if b.strip()]
        else:
            out[field] = value
    return out


def env_used(env: Mapping[str, str]) -> dict[str, str]:
    """The overrides set in ``env``, by variable (for ``kvplane info`` and the startup line)."""
    return {name: env[name] for name in ENV_FIELDS if env.get(name, "").strip()}


def blame(message: str, env: Mapping[str, str]) -> str:
    """A config error ``message`` with the variables of ``env`` that set the field it names (``$.disagg.port=``),
    so the user looks in the environment, not the config file."""
    used = env_used(env)
    hits = [f"${name}={value!r}" for name, value in used.items() if f".{ENV_FIELDS[name]}=" in message]
    return f"{message} (set by {', '.join(hits)}, which overrides the config)" if hits else message
