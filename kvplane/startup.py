"""The one INFO line a kvplane rank logs when its flows are up: what was configured, to paste into a bug report.

``describe`` reads the live objects (never the raw config alone): the device backend, the KV layouts chosen per
family, each P/D side's transport, protocol, side-channel address and port, the transport's own address, whether
the side channel is authenticated (CURVE), and the offload tiers' sizes. The vLLM connector logs it after
``register_kv_caches``; another engine calls ``log_startup`` once its flows exist.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from kvplane.kv.binding import LayoutChoice, layouts_by_family

logger = logging.getLogger("kvplane")
MiB = 1 << 20


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes} B"


def _protocol(side: Any) -> str:
    transport = side.local.transport
    if transport.name == "mooncake":
        return str(getattr(side.config, "protocol", "") or side.backend.mooncake_protocol)
    if transport.name == "nixl":
        backends = getattr(side.config, "nixl_backends", None) or ("UCX",)
        return f"{'+'.join(backends)} {side.backend.nixl_memory_type}"
    return "-"


def _side(role: str, side: Any) -> str:
    from kvplane.flows.disagg.wire.auth import secret_key

    c = side.config
    auth = "on" if secret_key(c)[0] else "off"
    port = getattr(side, "port", None)
    where = f"{c.host}:{port}" if port else f"{c.host} (connects out)"
    return (f"{role} mode={c.mode} rank={c.rank}/{c.tp_size} transport={side.local.transport.name} "
            f"protocol={_protocol(side)} side_channel={where} {_engine(side.local.transport)} auth={auth}")


def _engine(transport: Any) -> str:
    """Where peers reach the transfer engine: Mooncake TE's ``host:rpc_port`` (a port to open); NIXL's agent name
    (UCX picks its own ports, so there is no address to give)."""
    try:
        info = transport.peer_info()
    except Exception:  # a transport that cannot say: the line still goes out
        return "engine_address=?"
    if transport.name == "nixl":
        return f"nixl_agent={info.name}"
    return f"engine_address={info.name}"


def _offload(engine: Any) -> str:
    pool = engine.pool
    text = f"offload host={_size(pool.nbytes)} ({pool.num_blocks} blocks)"
    if engine.store is not None:
        s = engine.store.tier.config
        text += (f" store={s.master_address} protocol={s.protocol} segment={_size(s.segment_bytes)} "
                 f"write_through={s.write_through}")
    return text


def describe(backend: Any, layouts: LayoutChoice | None, *, offload: Any = None, prefill: Any = None,
             decode: Any = None, engine_id: str = "", families: Collection[str] | None = None) -> str:
    """``families``: the KV families the model has (its spec's), so the line names only the layouts in use."""
    parts = [f"kvplane {engine_id}".rstrip() + f": backend={backend.label}"]
    chosen = layouts_by_family(layouts if layouts is not None else backend.layouts)
    if families is not None:
        chosen = {f: layout for f, layout in chosen.items() if f in families}
    parts.append("layout=" + ",".join(f"{family}:{layout.name}" for family, layout in sorted(chosen.items())))
    for role, side in (("prefill", prefill), ("decode", decode)):
        if side is not None:
            parts.append(_side(role, side))
    parts.append(_offload(offload) if offload is not None else "offload=off")
    return "; ".join(parts)


def log_startup(backend: Any, layouts: LayoutChoice | None, **flows: Any) -> None:
    logger.info("%s", describe(backend, layouts, **flows))
