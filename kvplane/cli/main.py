"""Entry point of the ``kvplane`` command."""

from __future__ import annotations

import argparse
import json
import sys

from kvplane.errors import KvplaneError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplane", description="KV-cache transfer layer for LLM inference engines")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, backends, transfer engines")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    bench = sub.add_parser("bench", help="time kvplane against the raw baseline in the same process")
    bench.add_argument("--quick", action="store_true", help="fewer tokens and repetitions")
    bench.add_argument("--scenario", action="append", metavar="NAME", help="run only this scenario (repeatable)")
    bench.add_argument("--list", action="store_true", help="list scenarios and exit")
    bench.add_argument("--json", metavar="PATH", default="bench-results/bench.json", help="results file")
    bench.add_argument("--plot", metavar="PATH", default="bench-results/bench.png", help="plot file (PNG)")
    bench.add_argument("--device", metavar="NAME", help="backend to use (default: $KVPLANE_DEVICE or auto)")
    from kvplane.cli.conformance import add_arguments

    add_arguments(sub.add_parser("conformance", help="certify a backend: run the conformance suite, print a report"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            from kvplane.cli.info import collect, render

            data = collect()
            print(json.dumps(data, indent=2) if args.json else render(data))
            return 0
        if args.command == "conformance":
            from kvplane.cli.conformance import run

            return run(args)
        return _bench(args)
    except KvplaneError as e:
        print(f"kvplane: error: {e}", file=sys.stderr)
        return 2


def _bench(args: argparse.Namespace) -> int:
    try:
        from rich.console import Console

        from kvplane.bench import runner
    except ImportError as e:  # rich and matplotlib are the bench extra's, not runtime dependencies
        raise KvplaneError(f"kvplane bench needs its extra ({e}); pip install 'kvplane[bench]'") from e
    from kvplane.backend.registry import get_backend
    from kvplane.bench import scenarios

    if args.list:
        for s in scenarios.load_all().values():
            print(f"{s.name:<40} {s.kind:<8} {'default' if s.default else ''}")
        return 0
    backend = get_backend(args.device)
    console = Console(width=None if sys.stdout.isatty() else 150)  # logs and pipes get the whole table
    console.print(f"kvplane bench on backend [bold]{backend.label}[/bold]" + (" (quick)" if args.quick else ""))
    runner.run(
        backend,
        scenarios.select(args.scenario),
        quick=args.quick,
        json_path=args.json,
        plot_path=args.plot,
        console=console,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
