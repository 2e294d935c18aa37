"""What ``kvplane info`` says about the P/D side channel a connector config would open: the advertised and bind
addresses, every (DP rank, TP rank) port, the transport options, and the environment overrides that applied.

The config is ``kv_connector_extra_config`` (or a whole ``--kv-transfer-config`` holding one), as a path or
inline JSON; without one, the connector's defaults with the environment's overrides. It is checked exactly as
the connector checks it, and its authentication as each side checks it when it starts (``auth.check``, for the
config's ``kv_role`` or ``--role``), so a config that vLLM or a side would refuse is reported with the same error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvplane.cli.system import redact
from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.addresses import env_used
from kvplane.flows.disagg.wire.auth import CurveKeys, Role, check
from kvplane.flows.disagg.wire.config import DisaggConfig
from kvplane.flows.disagg.wire.errors import DisaggConfigError
from kvplane.integrations.vllm.config import ConnectorConfig

ENGINE_PORTS = (
    "Mooncake: an RPC port per rank from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (15000-17000 by default) on 0.0.0.0, "
    "and with protocol tcp a data port; NIXL/UCX over tcp: ports the OS picks unless UCX_TCP_PORT_RANGE is set "
    "(docs/deploy.md)"
)


SIDES: dict[str, tuple[Role, ...]] = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def load(source: str | None) -> tuple[dict[str, Any], str | None]:
    """``kv_connector_extra_config`` from a path or inline JSON ({} for none), and the ``kv_role`` of a whole
    ``--kv-transfer-config`` (None when the source is the extra config alone)."""
    if not source:
        return {"disagg": {}}, None
    text = Path(source).read_text() if not source.lstrip().startswith("{") else source
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvplaneError(f"--config {source[:60]!r} is not JSON ({e}); pass a file or inline JSON") from e
    if not isinstance(raw, Mapping):
        raise KvplaneError(f"--config holds {type(raw).__name__}, not an object of kv_connector_extra_config keys")
    extra = raw.get("kv_connector_extra_config", raw)
    role = raw.get("kv_role") if "kv_connector_extra_config" in raw else None
    return (dict(extra) if isinstance(extra, Mapping) else {}), (str(role) if role is not None else None)


def report(source: str | None, tp_size: int, dp_size: int, env: Mapping[str, str] | None = None,
           role: str | None = None) -> dict[str, Any]:
    """The side channel of an instance with ``dp_size`` DP ranks of ``tp_size`` TP ranks on one host, checked for
    ``role`` (``prefill``, ``decode`` or ``both``; None: the config's ``kv_role``, else both) as the sides check
    it when they start (``auth.check``)."""
    env = os.environ if env is None else env
    shown = "(inline JSON)" if source and source.lstrip().startswith("{") else source  # may hold a secret key
    out: dict[str, Any] = {"config": shown or "(defaults)", "tp_size": tp_size, "dp_size": dp_size,
                           "overrides": env_used(env)}
    try:
        extra, kv_role = load(source)
        given = role is not None or kv_role is not None
        if role is None:
            role = KV_ROLES.get(kv_role or "kv_both", "both")
        out["role"] = role
        if "disagg" not in extra:
            out["note"] = "the config has no 'disagg' section: this instance opens no side channel"
            return out
        out["disagg"] = redact(extra["disagg"])  # as written, secret keys hidden
        ports = []
        first = None
        keys = None
        for d in range(dp_size):
            config = ConnectorConfig.from_extra(extra, role="kv_both", engine_id="info", tp_size=tp_size,
                                                dp_rank=d, env=env)
            for r in range(tp_size):
                rank = config.disagg_for(r)
                first = first or rank
                for side in SIDES[role]:
                    keys = _check_auth(rank, side, env, role_given=given)
                ports.append({"dp_rank": d, "tp_rank": r, "port": rank.rank_port()})
    except (KvplaneError, ValueError, OSError) as e:
        out["error"] = str(e)  # the connector would not start with it
        return out
    if first is None:
        out["error"] = f"dp_size={dp_size} and tp_size={tp_size} must be >= 1"
        return out
    out.update({
        "advertised_host": first.host, "bind_host": first.listen_host, "base_port": first.port,
        "ports": ports, "transport": first.transport, "mode": first.mode,
        "mooncake_protocol": first.protocol or "(the backend's)",
        "mooncake_device_name": first.device_name or "(discover)",
        "nixl_backends": list(first.nixl_backends),
        "authenticated": keys is not None,
        "engine_ports": ENGINE_PORTS,
    })
    return out


def _check_auth(rank: DisaggConfig, side: Role, env: Mapping[str, str], *, role_given: bool) -> CurveKeys | None:
    """``auth.check``, the sides' own rule; a refusal says which side refused and how to check another role."""
    try:
        return check(rank, side, env)
    except DisaggConfigError as e:
        hint = "" if role_given else " (checked as a kv_both instance: pass --role prefill or decode, or a config " \
                                     "with kv_role)"
        raise DisaggConfigError(f"the {side} side would refuse to start: {e}{hint}") from e


def render(side: dict[str, Any]) -> list[str]:
    lines = [f"side channel ({side['config']}, dp={side['dp_size']} x tp={side['tp_size']}):"]
    if side.get("overrides"):
        lines.append("  environment overrides: " + ", ".join(f"{k}={v}" for k, v in side["overrides"].items()))
    if "error" in side or "note" in side:
        return [*lines, f"  error: {side['error']}" if "error" in side else f"  {side['note']}"]
    lines.append(f"  advertised {side['advertised_host']}, bind {side['bind_host']}, base port {side['base_port']}, "
                 f"auth {'CURVE' if side['authenticated'] else 'off'}")
    lines.append("  ports: " + ", ".join(f"dp{p['dp_rank']}/tp{p['tp_rank']}={p['port']}" for p in side["ports"]))
    lines.append(f"  transport {side['transport']} ({side['mode']}); mooncake protocol {side['mooncake_protocol']}, "
                 f"NICs {side['mooncake_device_name']}; nixl backends {side['nixl_backends']}")
    lines.append(f"  engines: {side['engine_ports']}")
    return lines
