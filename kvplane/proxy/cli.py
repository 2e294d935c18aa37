"""``kvplane proxy``: the subcommand's flags, and serving the app until SIGINT / SIGTERM.

On a signal aiohttp stops accepting, gives in-flight requests ``--shutdown-timeout`` seconds, then cancels the
rest (their legs' connections close, so the instances abort them) and exits.
"""

from __future__ import annotations

import argparse
import logging

from kvplane.errors import KvplaneError
from kvplane.flows.disagg.wire.config import MODES
from kvplane.proxy.config import ON_PREFILL_FAILURE, ON_TRANSFER_FAILURE, POLICIES, Instance, ProxyConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True,
                   metavar="URL[,engine_id=ID,side_channel=H:P,kv_events=tcp://H:P,kv_events_replay=tcp://H:P]",
                   help="a prefill instance (repeat for several); push modes need engine_id and side_channel, "
                        "--policy kv-aware kv_events")
    p.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode instance (repeat)")
    p.add_argument("--mode", choices=MODES, default="pull", help="kvplane's disagg.mode on the instances")
    p.add_argument("--policy", choices=POLICIES, default="round-robin",
                   help="instance selection; kv-aware: the prefill holding most of the prompt, against load")
    p.add_argument("--kv-index-entries", type=int, default=100_000,
                   help="kv-aware: most entries of the prefix index per instance and tier (least recent go first)")
    p.add_argument("--kv-silence", type=float, default=10.0,
                   help="kv-aware: seconds a prefill may stay without KV events after caching new blocks")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout", type=float, default=120.0, help="seconds for the whole prefill leg")
    p.add_argument("--decode-timeout", type=float, default=300.0, help="seconds without a byte from the decode")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between GET /health checks")
    p.add_argument("--health-timeout", type=float, default=5.0, help="seconds one GET /health check may take")
    p.add_argument("--health-failures", type=int, default=3,
                   help="failed health checks in a row that take an instance out of rotation")
    p.add_argument("--on-prefill-failure", choices=ON_PREFILL_FAILURE, default="error",
                   help="answer an error, or let the decode compute the prompt itself")
    p.add_argument("--on-transfer-failure", choices=ON_TRANSFER_FAILURE, default="error",
                   help="answer a P/D decode's 5xx, or retry the request once on a decode without kv_transfer_params")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get on exit")


def config_from(args: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(
        prefill=tuple(Instance.parse(t, "prefill") for t in args.prefill),
        decode=tuple(Instance.parse(t, "decode") for t in args.decode),
        mode=args.mode, policy=args.policy, host=args.host, port=args.port,
        prefill_timeout_s=args.prefill_timeout, decode_timeout_s=args.decode_timeout,
        connect_timeout_s=args.connect_timeout, health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout, health_failures=args.health_failures,
        on_prefill_failure=args.on_prefill_failure, on_transfer_failure=args.on_transfer_failure,
        shutdown_timeout_s=args.shutdown_timeout, kv_index_entries=args.kv_index_entries,
        kv_silence_s=args.kv_silence,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from(args)
    try:
        from aiohttp import web

        from kvplane.proxy.app import SERVING, build_app
    except ImportError as e:
        raise KvplaneError(f'kvplane proxy needs aiohttp and prometheus_client ({e}); pip install "kvplane[proxy]"'
                           ) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvplane.proxy").info(
        "kvplane proxy on %s:%d, mode %s, policy %s, prefill %s, decode %s", config.host, config.port, config.mode,
        config.policy, [i.name for i in config.prefill], [i.name for i in config.decode])
    web.run_app(build_app(config), host=config.host, port=config.port, shutdown_timeout=config.shutdown_timeout_s,
                print=None, **SERVING)
    return 0
