"""The conformance report: which backend ran, each check's outcome, the bandwidth figures, and notes.

The plugin fills it while pytest runs and writes it as JSON (``--kvplane-report``); ``kvplane conformance``
reads that file back and prints it with ``render``. Bandwidth is reported, never asserted.
"""

from __future__ import annotations

import msgspec


class CheckResult(msgspec.Struct, frozen=True):
    """One test: its check (the test function) and parameters, outcome and, for a skip or failure, why."""

    check: str
    params: str
    outcome: str  # passed, failed, skipped
    detail: str = ""
    seconds: float = 0.0


class BandwidthResult(msgspec.Struct, frozen=True):
    """One scattered-block copy timed against a contiguous ``copy_`` of the same bytes, in the same run."""

    direction: str
    nbytes: int
    descriptors: int
    gbps: float
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps if self.baseline_gbps else 0.0


class ConformanceReport(msgspec.Struct):
    backend: str = ""
    label: str = ""
    emulated: bool = False
    probe_reason: str = ""
    copy_path: str = ""
    checks: list[CheckResult] = msgspec.field(default_factory=list)
    bandwidth: list[BandwidthResult] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for c in self.checks:
            out[c.outcome] = out.get(c.outcome, 0) + 1
        return out

    @property
    def ok(self) -> bool:
        return bool(self.checks) and self.counts()["failed"] == 0

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> ConformanceReport:
        return msgspec.json.decode(data, type=cls)


def render(report: ConformanceReport) -> str:
    """The report as text: backend label, each check, bandwidth, notes, and the totals."""
    out: list[str] = []
    out.append(f"kvplane conformance: backend {report.label or report.backend}")
    if report.probe_reason:
        out.append(f"  probe: {report.probe_reason}")
    if report.copy_path:
        out.append(f"  plans run through: {report.copy_path}")
    out.append("checks:")
    for c in report.checks:
        name = f"{c.check}[{c.params}]" if c.params else c.check
        detail = f" - {c.detail}" if c.detail and c.outcome != "passed" else ""
        out.append(f"  {c.outcome.upper():<7} {name}{detail}")
    if report.bandwidth:
        out.append("bandwidth (reported, not asserted): scattered blocks vs a contiguous copy_ of the same bytes")
        for b in report.bandwidth:
            out.append(
                f"  {b.direction}  {b.nbytes / (1 << 20):8.1f} MiB  {b.descriptors:6d} descriptors  "
                f"{b.gbps:7.2f} GB/s  vs {b.baseline_gbps:7.2f} GB/s  ratio {b.ratio:.2f}"
            )
    for note in report.notes:
        out.append(f"note: {note}")
    n = report.counts()
    out.append(f"result: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped on {report.label}")
    return "\n".join(out)
