"""``kvplane conformance``: run the conformance suite against one backend and print its report.

The suite runs in a pytest subprocess (``pytest -p kvplane.conformance --pyargs kvplane.conformance``) from a
scratch directory, so
the caller's own pytest configuration and caches stay out of it; the plugin writes the report as JSON and this
command prints it: the backend label (with "(emulated)"), each check, the bandwidth figures. The exit status
is pytest's: 0 when every check passed or was skipped with a reason. It needs the ``conformance`` extra (pytest).

This command is a test tool's entry: ``--emulate`` certifies ``<NAME>-emulated``, the emulated backend that
``kvplane.testing`` adds when the pytest process is given ``-p kvplane.testing.pytest_plugin``. The command only
names that plugin; no kvplane module outside ``kvplane.testing`` imports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvplane.backend.registry import ENV_VAR
from kvplane.errors import KvplaneError

USAGE_ERROR = 2
EMULATED_SUFFIX = "-emulated"  # the name kvplane.testing gives an emulated backend
EMULATION_PLUGIN = "kvplane.testing.pytest_plugin"


def _has_pytest() -> bool:
    try:
        return importlib.util.find_spec("pytest") is not None
    except (ImportError, ValueError):
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", metavar="NAME", help=f"backend to certify (default: ${ENV_VAR} or auto)")
    parser.add_argument("--emulate", action="store_true",
                        help="certify NAME-emulated, the test double of NAME (CPU memory, never hardware)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument("--bandwidth-mib", type=int, default=64, metavar="MIB",
                        help="MiB per bandwidth measurement (default 64)")
    parser.add_argument("-k", metavar="EXPR", dest="select", help="run only the checks matching EXPR (pytest -k)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output as it runs")


def run(args: argparse.Namespace) -> int:
    if not _has_pytest():  # pytest is the conformance extra's, not a runtime dependency
        raise KvplaneError("kvplane conformance runs the suite with pytest, which is not installed here; "
                           "pip install 'kvplane[conformance]'")
    from kvplane.conformance.report import ConformanceReport, render

    env = dict(os.environ)
    device: str | None = args.device or env.get(ENV_VAR) or None
    plugins = ["-p", "kvplane.conformance"]
    if args.emulate:
        if device is None:
            print(f"kvplane: error: --emulate needs --device NAME (or ${ENV_VAR})", file=sys.stderr)
            return USAGE_ERROR
        device = device if device.endswith(EMULATED_SUFFIX) else device + EMULATED_SUFFIX
        plugins += ["-p", EMULATION_PLUGIN]
    with tempfile.TemporaryDirectory(prefix="kvplane-conformance-") as scratch:
        report_path = Path(args.json).resolve() if args.json else Path(scratch) / "report.json"
        report_path.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "pytest", *plugins, "--pyargs", "kvplane.conformance", "-p", "no:cacheprovider",
            "-q" if not args.verbose else "-v", f"--kvplane-report={report_path}",
            f"--kvplane-bandwidth-mib={args.bandwidth_mib}",
        ]
        if device is not None:
            command.append(f"--kvplane-device={device}")
        if args.select:
            command += ["-k", args.select]
        proc = subprocess.run(command, cwd=scratch, env=env, text=True, capture_output=not args.verbose)
        if not report_path.exists():  # stopped before any check ran: an unknown or unavailable backend
            print(f"kvplane: error: the conformance suite did not run (pytest exit {proc.returncode})",
                  file=sys.stderr)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    print(stream.strip(), file=sys.stderr)
            return USAGE_ERROR
        if args.verbose:
            return proc.returncode  # pytest printed the report itself
        if proc.returncode != 0:
            print(proc.stdout)  # pytest's failures, followed by the report
        else:
            print(render(ConformanceReport.decode(report_path.read_bytes())))
        return proc.returncode
