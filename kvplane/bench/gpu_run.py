"""The GPU run as one prepared call (docs/gpu.md): ``python -m kvplane.bench.gpu_run --out DIR``.

Each part runs in its own child process under its own time limit, so one hang costs that part alone:
``info`` (``kvplane info``), ``conformance`` (``kvplane conformance``), ``offload`` (scattered blocks d2h/h2d
against a pinned contiguous ``copy_``: Qwen3-0.6B and DeepSeek-V3, 16- and 64-token blocks, per-layer and
cross-layer caches, and the offload engine's rows), ``sweep`` (descriptor sizes 1-256 KiB by every copy route)
``pd`` (NIXL READ and WRITE of 10k tokens between two processes on one device, against the raw agent, and
the disaggregation flow's pull and push, a part per row, with UCX's protocol choices in the log), ``engine``
(the offload engine's store and load rows) and ``tune-*`` (the copy kernel's variants on the small-block rows).
After every part ``report.md`` and ``report.json`` in DIR are rewritten with every part's status and every row's
figures, so a run cut short keeps what it measured; the run's whole output is in ``run.log`` and the engines'
in ``bench.log``: four files in all (a device call returns at most eight). ``scripts/gpu/run.sh`` installs
kvplane and calls this; its CPU twin (``--device cpu --quick``) runs in ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvplane.bench.gpu_report import render_markdown

MODELS = ("qwen3-0.6b", "deepseek-v3")
DIRECTIONS = ("d2h", "h2d")


@dataclass
class Part:
    name: str
    argv: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)  # set for this part's process alone
    status: str = "not run"  # ok, failed (exit N), timed out after N s
    seconds: float = 0.0


def copy_rows(model: str, quick: bool) -> list[str]:
    if quick:
        return [f"copy-{model}-{d}-bs16{xl}" for d in DIRECTIONS for xl in ("", "-xl")] if model == MODELS[1] else []
    return [f"copy-{model}-{d}-bs{bs}{xl}" for d in DIRECTIONS for bs in (16, 64) for xl in ("", "-xl")]


def engine_rows(quick: bool) -> list[str]:
    if quick:
        return ["offload-deepseek-v3-store", "offload-deepseek-v3-load"]
    return [f"offload-{m}-{op}{xl}" for m in MODELS for op in ("store", "load") for xl in ("", "-xl")]


def sweep_rows(quick: bool) -> list[str]:
    sizes = (4, 64) if quick else (1, 4, 16, 64, 256)
    return [f"sweep-{d}-{k}k" for d in DIRECTIONS for k in sizes]


def pd_rows(quick: bool) -> dict[str, list[str]]:
    """Rows by part: on a GPU one part per row (a slow or hung transfer costs its own row alone); the quick run
    (the CPU twin) puts both in one part, one peer process fewer."""
    rows = {f"pd-{op}": [f"pd-nixl-qwen3-0.6b-{op}-vram"] for op in ("read", "write")}
    if quick:
        return {"pd": [row for part in rows.values() for row in part]}
    return {**rows, **{f"pd-flow-{m}": [f"pd-flow-nixl-qwen3-0.6b-{m}"] for m in ("pull", "push")}}


# kernel variants beside the default (CHUNK 8 KiB, 16-byte hint on), on the rows where small descriptors rule
TUNE_ROWS = ["copy-deepseek-v3-d2h-bs16", "copy-deepseek-v3-h2d-bs16", "sweep-d2h-16k", "sweep-h2d-16k"]
TUNE_VARIANTS = {
    "tune-chunk2k": {"KVPLANE_COPY_KERNEL_CHUNK": "2048"},
    "tune-chunk32k": {"KVPLANE_COPY_KERNEL_CHUNK": "32768"},
    "tune-nohint": {"KVPLANE_COPY_KERNEL_HINT16": "0"},
}
UCX_DIAGNOSTICS = {"UCX_PROTO_INFO": "y"}  # UCX prints the protocol and transports each transfer takes


def parts(out: Path, device: str, quick: bool) -> list[Part]:
    """The parts in the order they run: the figures the run is for first, each under its own time limit."""
    kvplane = [sys.executable, "-m", "kvplane.cli.main"]
    slack = 4.0 if quick else 1.0  # the limits guard a GPU lease; the twin on a loaded CI machine needs no hurry

    def bench(name: str, rows: list[str], timeout_s: float, full: bool = False,
              env: dict[str, str] | None = None) -> Part:
        argv = [*kvplane, "bench", "--device", device, "--json", str(out / f"bench-{name}.json"), "--plot", "",
                "--log", str(out / f"bench-{name}.log"), *(["--quick"] if quick else []), *(["--full"] if full else [])]
        for row in rows:
            argv += ["--scenario", row]
        return Part(name, argv, timeout_s * slack, env or {})

    chosen = [
        Part("info", [*kvplane, "info"], 45 * slack),
        bench("copy-dsv3", copy_rows(MODELS[1], quick), 75),
        bench("copy-qwen3", copy_rows(MODELS[0], quick), 75),
        bench("sweep", sweep_rows(quick), 60),
        *[bench(name, rows, 75, full=not quick, env=UCX_DIAGNOSTICS) for name, rows in pd_rows(quick).items()],
        Part("conformance", [*kvplane, "conformance", "--device", device, "--json", str(out / "conformance.json"),
                             *(["--bandwidth-mib", "8"] if quick else [])], 90 * slack),
        bench("engine", engine_rows(quick), 75),
        *([] if quick else [bench(name, TUNE_ROWS, 45, env=env) for name, env in TUNE_VARIANTS.items()]),
    ]
    return [p for p in chosen if "bench" not in p.argv or "--scenario" in p.argv]  # quick runs skip some


def run_part(part: Part, log: Any) -> str:
    """Run one part, its output appended to ``log``; its stdout."""
    log.write(f"\n===== {part.name}: {' '.join(part.argv)}\n")
    log.flush()
    start = time.monotonic()
    try:
        done = subprocess.run(part.argv, capture_output=True, text=True, timeout=part.timeout_s,
                              env={**os.environ, **part.env})
        output = done.stdout + done.stderr
        part.status = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        part.status = f"timed out after {part.timeout_s:.0f} s"
    part.seconds = round(time.monotonic() - start, 1)
    log.write(output)
    log.write(f"\n===== {part.name}: {part.status} in {part.seconds} s\n")
    log.flush()
    return output


def machine() -> dict[str, Any]:
    import platform

    import torch

    found: dict[str, Any] = {"python": platform.python_version(), "torch": str(torch.__version__),
                             "torch_cuda": torch.version.cuda, "cpus": os.cpu_count()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,pcie.link.gen.max,"
                              "pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        found["nvidia_smi"] = f"not available ({type(e).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["torch_device"] = f"{props.name}, {props.total_memory >> 20} MiB, {props.multi_processor_count} SMs"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvplane.bench.gpu_run", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for report.md, report.json and the logs")
    parser.add_argument("--device", default="cuda", help="backend (default cuda; cpu for the twin)")
    parser.add_argument("--quick", action="store_true", help="fewer rows and tokens (the CPU twin)")
    parser.add_argument("--only", action="append", metavar="PREFIX",
                        help="run only the parts whose names start with PREFIX (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvplane-gpu-run-"))  # bench JSON and logs, folded into out/ as they come
    chosen = [p for p in parts(work, args.device, args.quick)
              if not args.only or any(p.name.startswith(prefix) for prefix in args.only)]
    outputs: dict[str, str] = {}
    found = machine()
    with open(out / "run.log", "a") as log:
        for part in chosen:
            outputs[part.name] = run_part(part, log)
            print(f"{part.name}: {part.status} in {part.seconds} s", flush=True)
            engine_log = work / f"bench-{part.name}.log"
            if engine_log.exists():
                with open(out / "bench.log", "a") as logs:
                    logs.write(f"\n===== {part.name}\n{engine_log.read_text(errors='replace')}")
            write_report(out, work, args, found, chosen, outputs)  # after every part: a cut run keeps what it has
    shutil.rmtree(work, ignore_errors=True)
    print(f"report: {out / 'report.md'}")
    return 0 if all(p.status == "ok" for p in chosen) else 1


def write_report(out: Path, work: Path, args: argparse.Namespace, found: dict[str, Any], chosen: list[Part],
                 outputs: dict[str, str]) -> None:
    report = {
        "device": args.device, "quick": args.quick, "machine": found,
        "parts": [asdict(p) for p in chosen],
        "info": outputs.get("info", ""),
        "conformance": _load(work / "conformance.json"),
        "results": [{**r, "part": p.name} for p in chosen
                    for r in (_load(work / f"bench-{p.name}.json") or {}).get("results", [])],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render_markdown(report))


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
