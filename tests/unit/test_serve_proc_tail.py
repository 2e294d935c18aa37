"""A server that exits before it is ready is reported with its log's first traceback (the root cause vLLM's
"Engine core initialization failed. See root cause above" points to) as well as its last lines."""

from __future__ import annotations

import sys
from pathlib import Path

from kvplane.bench.serve.procs import Server


def test_the_report_of_a_failed_start_holds_the_first_traceback_and_the_last_lines(tmp_path: Path) -> None:
    lines = ["starting"] + ["Traceback (most recent call last):", "  File x", "OSError: the root cause"] + \
        [f"noise {i}" for i in range(100)] + ["RuntimeError: Engine core initialization failed. See root cause above."]
    server = Server("prefill", [sys.executable, "-c", "pass"], "http://127.0.0.1:1",
                    tmp_path)
    server.proc.wait(timeout=60)
    server.log.write_text("\n".join(lines) + "\n")
    report = server.tail()
    assert "OSError: the root cause" in report and "Engine core initialization failed" in report
    assert "noise 50" not in report  # the middle stays out
    short = tmp_path / "short"
    short.mkdir()
    quiet = Server("decode", [sys.executable, "-c", "pass"], "http://127.0.0.1:1", short)
    quiet.proc.wait(timeout=60)
    quiet.log.write_text("Traceback (most recent call last):\nValueError: late\n")
    assert quiet.tail().count("ValueError: late") == 1  # a traceback within the last lines is not shown twice
