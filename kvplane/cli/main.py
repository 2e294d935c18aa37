"""Entry point of the ``kvplane`` command."""

from __future__ import annotations

import argparse
import sys

from kvplane.errors import KvplaneError


def _parser() -> argparse.ArgumentParser:
    from kvplane import __version__

    p = argparse.ArgumentParser(prog="kvplane", description="KV-cache transfer layer for LLM inference engines")
    p.add_argument("--version", action="version", version=f"kvplane {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    from kvplane.cli.info import add_arguments as add_info_arguments

    add_info_arguments(sub.add_parser("info", help="the report for a bug: versions, drivers, NICs, env, ports"))
    bench = sub.add_parser("bench", help="time kvplane against the raw baseline in the same process")
    bench.add_argument("--quick", action="store_true", help="fewer tokens")
    bench.add_argument("--full", action="store_true", help="every scenario at full size (the sweeps; minutes)")
    bench.add_argument("--scenario", action="append", metavar="NAME", help="run only this scenario (repeatable)")
    bench.add_argument("--list", action="store_true", help="list scenarios and exit")
    bench.add_argument("--json", metavar="PATH", default="bench-results/bench.json", help="results file")
    bench.add_argument("--plot", metavar="PATH", default="bench-results/bench.png", help="plot file (PNG)")
    bench.add_argument("--log", metavar="PATH", default="bench-results/bench.log", help="engine log file")
    bench.add_argument("--device", metavar="NAME", help="backend to use (default: $KVPLANE_DEVICE or auto)")
    from kvplane.cli.conformance import add_arguments

    add_arguments(sub.add_parser("conformance", help="certify a backend: run the conformance suite, print a report"))
    from kvplane.cli.keys import add_arguments as add_keys_arguments

    add_keys_arguments(sub.add_parser("keys", help="write a CURVE key pair for the side channel: NAME.key, NAME.pub"))
    from kvplane.proxy.cli import add_arguments as add_proxy_arguments

    add_proxy_arguments(sub.add_parser("proxy", help="OpenAI-compatible P/D router (docs/proxy.md)"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            from kvplane.cli.info import run as info

            return info(args)
        if args.command == "proxy":
            from kvplane.proxy.cli import run as run_proxy

            return run_proxy(args)
        if args.command == "keys":
            from kvplane.cli.keys import run as run_keys

            return run_keys(args)
        if args.command == "conformance":
            from kvplane.cli.conformance import run

            return run(args)
        return _bench(args)
    except KvplaneError as e:
        print(f"kvplane: error: {e}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    from kvplane.backend.registry import get_backend
    from kvplane.bench import runner, scenarios

    if args.list:
        default = {s.name for s in scenarios.default()}
        listed = {s.name: s for s in scenarios.default() + scenarios.full()}
        for s in listed.values():
            print(f"{s.name:<44} {s.kind:<8} {'default' if s.name in default else 'full'}")
        return 0
    backend = get_backend(args.device)
    runner.run(
        backend,
        scenarios.select(args.scenario, args.full),
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        log_path=args.log,
        terminal=sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
