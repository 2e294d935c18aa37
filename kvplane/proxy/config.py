"""What the proxy routes to and how: ``Instance`` (one engine's URL and side channel) and ``ProxyConfig``.

Push and layer-wise need, per prefill instance, what a decode must be told before the prefill has run: the
engine id (vLLM: ``kv_transfer_config.engine_id``, set it on the prefill's command line), the side-channel host
and base port (kvplane's ``disagg.host`` / ``disagg.port``) and the TP size. The proxy learns them from its own
command line, one ``--prefill`` per instance::

    --prefill http://10.0.0.7:8100,engine_id=prefill-0,side_channel=10.0.0.7:5600,tp_size=1

(``side_channel`` defaults to the URL's host with no port, which pull mode does not need.) An instance that runs
``--data-parallel-size N`` (one API server over N engines) takes ``dp_size=N``: the proxy then routes to each DP
rank as a target of its own (``Instance.ranks``), names it in vLLM's ``X-data-parallel-rank`` header, tells a
push decode that rank's engine id (``ID_dp<rank>``) and side channel (``port + dp_rank * tp_size``) and reads
that rank's KV events (vLLM's endpoint port ``+ dp_rank``). ``--policy kv-aware
needs, per prefill, the address of its vLLM KV-event publisher (``--kv-events-config``'s ``endpoint``, and its
``replay_endpoint`` to fill gaps)::

    --prefill http://10.0.0.7:8100,kv_events=tcp://10.0.0.7:5557,kv_events_replay=tcp://10.0.0.7:5558

Every check runs at startup and names the flag, the value and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal
from urllib.parse import urlsplit

from kvplane.flows.disagg.wire.addresses import dp_base_port
from kvplane.flows.disagg.wire.config import MODES, Mode
from kvplane.proxy.errors import ProxyConfigError

Policy = Literal["round-robin", "least-outstanding", "kv-aware"]
POLICIES: tuple[Policy, ...] = ("round-robin", "least-outstanding", "kv-aware")
OnPrefillFailure = Literal["error", "decode-only"]
ON_PREFILL_FAILURE: tuple[OnPrefillFailure, ...] = ("error", "decode-only")
OnTransferFailure = Literal["error", "retry-plain"]
ON_TRANSFER_FAILURE: tuple[OnTransferFailure, ...] = ("error", "retry-plain")
INSTANCE_KEYS = ("engine_id", "side_channel", "tp_size", "dp_size", "kv_events", "kv_events_replay")
DP_HEADER = "X-data-parallel-rank"  # vLLM's API server sends a request with it to that DP rank's engine


@dataclass(frozen=True)
class Instance:
    url: str  # http://host:port, no path
    role: str  # "prefill" or "decode"
    engine_id: str = ""
    side_host: str = ""
    side_port: int = 0
    tp_size: int = 1
    kv_events: str = ""  # tcp://HOST:PORT of its vLLM KV-event PUB socket
    kv_events_replay: str = ""  # tcp://HOST:PORT of its replay ROUTER socket
    dp_size: int = 1
    dp_rank: int | None = None  # the DP rank this target names (``ranks``); None: vLLM's API server picks one

    @property
    def name(self) -> str:
        """What the proxy keys this target by: its URL, and its DP rank where it names one (``URL#dp1``)."""
        return self.url if self.dp_rank is None else f"{self.url}#dp{self.dp_rank}"

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request to this target carries: the DP rank it names."""
        return {} if self.dp_rank is None else {DP_HEADER: str(self.dp_rank)}

    def ranks(self) -> tuple[Instance, ...]:
        """The routing targets of this instance: itself, or one per DP rank, each with that rank's engine id (vLLM
        appends ``_dp<rank>``), side-channel base port and KV-event endpoints (vLLM offsets a tcp port by the rank)."""
        if self.dp_size == 1 or self.dp_rank is not None:
            return (self,)
        return tuple(replace(self, dp_rank=r, engine_id=f"{self.engine_id}_dp{r}" if self.engine_id else "",
                             side_port=dp_base_port(self.side_port, r, self.tp_size),
                             kv_events=_offset(self.kv_events, r), kv_events_replay=_offset(self.kv_events_replay, r))
                     for r in range(self.dp_size))

    @classmethod
    def parse(cls, text: str, role: str) -> Instance:
        """``URL[,engine_id=ID][,side_channel=HOST:PORT][,tp_size=N][,kv_events=tcp://H:P][,kv_events_replay=tcp://H:P]``
        (the ``--prefill`` / ``--decode`` value)."""
        url, *options = [part.strip() for part in text.split(",")]
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ProxyConfigError(f"--{role} {text!r}: {url!r} is not an instance URL; give http://HOST:PORT "
                                   f"(the address of its `vllm serve`, without a path)")
        values: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in INSTANCE_KEYS:
                raise ProxyConfigError(f"--{role} {text!r}: option {option!r} is not KEY=VALUE with KEY one of "
                                       f"{INSTANCE_KEYS}")
            values[key] = value
        side_host, side_port = parts.hostname, 0
        if "side_channel" in values:
            host, sep, port = values["side_channel"].rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ProxyConfigError(f"--{role} {text!r}: side_channel={values['side_channel']!r} is not "
                                       f"HOST:PORT (kvplane's disagg.host and disagg.port of that instance)")
            side_host, side_port = host, int(port)
        tp, dp = values.get("tp_size", "1"), values.get("dp_size", "1")
        for key, n in (("tp_size", tp), ("dp_size", dp)):
            if not n.isdigit() or int(n) < 1:
                raise ProxyConfigError(f"--{role} {text!r}: {key}={n!r} is not a positive integer")
        for key in ("kv_events", "kv_events_replay"):
            if key in values:
                _check_zmq_address(role, text, key, values[key])
                if int(dp) > 1 and not values[key].startswith("tcp://"):
                    raise ProxyConfigError(f"--{role} {text!r}: {key}={values[key]!r} with dp_size={dp}: vLLM gives "
                                           f"each DP rank the endpoint's tcp port + its rank and refuses ipc:// "
                                           f"there; give tcp://HOST:PORT")
        return cls(url.rstrip("/"), role, values.get("engine_id", ""), side_host, side_port, int(tp),
                   values.get("kv_events", ""), values.get("kv_events_replay", ""), int(dp))


def _offset(endpoint: str, rank: int) -> str:
    """A tcp endpoint's port plus ``rank``, as vLLM's ``ZmqEventPublisher.offset_endpoint_port`` makes it."""
    if not endpoint or not rank:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}"


def _check_zmq_address(role: str, text: str, key: str, address: str) -> None:
    """An address the proxy connects to: ``tcp://HOST:PORT`` (vLLM's ``tcp://*:5557`` is where the instance binds;
    the proxy names the instance's host instead) or ``ipc://PATH``."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    tcp_ok = scheme == "tcp" and colon and host and host != "*" and port.isdigit() and 0 < int(port) < 65536
    if not sep or not (tcp_ok or (scheme == "ipc" and rest)):
        raise ProxyConfigError(f"--{role} {text!r}: {key}={address!r} is not tcp://HOST:PORT (or ipc://PATH); give "
                               f"the instance's host and the port of its --kv-events-config "
                               f"{'endpoint' if key == 'kv_events' else 'replay_endpoint'}")


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's settings (``kvplane proxy --help`` lists them as flags).

    ``prefill_timeout_s`` bounds the whole prefill leg. ``decode_timeout_s`` bounds the wait for each byte of
    the decode's answer (a long generation that keeps streaming is never cut), and in push modes the wait for
    the first one. ``on_prefill_failure`` is ``error`` (a 502/504 naming the prefill) or ``decode-only`` (the
    decode computes the prompt itself). An instance leaves rotation after ``health_failures`` failed health checks
    in a row (each bounded by ``health_timeout_s``). ``on_transfer_failure`` is ``error`` (a decode's 5xx goes to
    the client) or ``retry-plain`` (the request is sent once more to a decode, without ``kv_transfer_params``).
    In-flight requests get ``shutdown_timeout_s`` to finish on SIGTERM.
    """

    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    mode: Mode = "pull"
    policy: Policy = "round-robin"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 3
    on_prefill_failure: OnPrefillFailure = "error"
    on_transfer_failure: OnTransferFailure = "error"
    shutdown_timeout_s: float = 30.0
    kv_index_entries: int = 100_000
    kv_silence_s: float = 10.0
    max_body_bytes: int = 64 << 20
    extra_headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):  # one routing target per DP rank
            object.__setattr__(self, role, tuple(r for inst in getattr(self, role) for r in inst.ranks()))
        if not self.prefill or not self.decode:
            raise ProxyConfigError(f"the proxy needs at least one --prefill and one --decode instance, got "
                                   f"{len(self.prefill)} and {len(self.decode)}")
        if self.mode not in MODES:
            raise ProxyConfigError(f"--mode {self.mode!r}: use one of {MODES}")
        if self.policy not in POLICIES:
            raise ProxyConfigError(f"--policy {self.policy!r}: use one of {POLICIES}")
        if self.on_prefill_failure not in ON_PREFILL_FAILURE:
            raise ProxyConfigError(f"--on-prefill-failure {self.on_prefill_failure!r}: use one of "
                                   f"{ON_PREFILL_FAILURE}")
        if self.on_transfer_failure not in ON_TRANSFER_FAILURE:
            raise ProxyConfigError(f"--on-transfer-failure {self.on_transfer_failure!r}: use one of "
                                   f"{ON_TRANSFER_FAILURE}")
        if not self.health_failures >= 1:
            raise ProxyConfigError(f"--health-failures {self.health_failures!r}: give the number of failed health "
                                   f"checks in a row that take an instance out of rotation, 1 or more")
        for name in ("prefill_timeout_s", "decode_timeout_s", "connect_timeout_s", "health_interval_s",
                     "health_timeout_s", "shutdown_timeout_s", "kv_silence_s"):
            if not getattr(self, name) > 0:
                raise ProxyConfigError(f"{name}={getattr(self, name)!r} must be > 0")
        self._check_kv_aware()
        if self.mode != "pull":
            for inst in self.prefill:
                if not inst.engine_id or not inst.side_port:
                    raise ProxyConfigError(
                        f"--mode {self.mode} needs each prefill's engine id and side channel, --prefill {inst.url} "
                        f"has engine_id={inst.engine_id!r}, side_channel port={inst.side_port}; give "
                        f"--prefill {inst.url},engine_id=ID,side_channel=HOST:PORT (the prefill's "
                        f"kv_transfer_config.engine_id and kvplane disagg.host:disagg.port)"
                    )

    def _check_kv_aware(self) -> None:
        if not self.kv_index_entries >= 1:
            raise ProxyConfigError(f"--kv-index-entries {self.kv_index_entries!r}: give the most entries the prefix "
                                   f"index keeps per instance and tier, 1 or more")
        if self.policy != "kv-aware":
            return
        for inst in self.prefill:
            if not inst.kv_events:
                raise ProxyConfigError(
                    f"--policy kv-aware needs each prefill's KV-event publisher, --prefill {inst.url} has no "
                    f"kv_events=; give --prefill {inst.url},kv_events=tcp://HOST:5557[,kv_events_replay="
                    f"tcp://HOST:5558] (start vLLM with --kv-events-config '{{\"enable_kv_cache_events\": true, "
                    f"\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                    f"\"tcp://*:5558\"}}' and prefix caching on), or use another --policy")
