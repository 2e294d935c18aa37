"""Issue 28, finding 2, measured: a heartbeat flood on one connection against a prefill rank in this process.

An attacker process (``attacker.py``) handshakes as a decode of its own and sends ``--messages`` heartbeats of
``MAX_HEARTBEAT_IDS`` ids each, all naming a request it knows the token of. Meanwhile a second connection of the
attacker's handshakes again and again: the longest wait for an answer is the stall the flood caused the prefill's
I/O loop. The prefill process's peak RSS (VmHWM, reset before the flood) and RSS after, against before, are the
memory figures. Not a test: it prints figures. Usage: ``.venv/bin/python tests/disagg/measure_flood.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "unit")]

from framed import FramedProcess  # noqa: E402
from pair import make, small_spec  # noqa: E402
from test_pd_attacks import arm, ask, heartbeat, pull_and_check  # noqa: E402

from kvplane.flows.disagg.wire.messages import MAX_HEARTBEAT_IDS  # noqa: E402


def status_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found is not None
    return int(found.group(1)) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=489)
    a = ap.parse_args()
    spec = small_spec()
    prefill, decode = make("prefill", spec, seed=3), make("decode", spec)
    with tempfile.TemporaryDirectory() as tmp:
        attacker = FramedProcess([str(Path(__file__).with_name("attacker.py"))], Path(tmp) / "attacker.log",
                                 env={"OMP_NUM_THREADS": "1"})
        attacker.read(120)
        try:
            params = pull_and_check(prefill, decode, "known")
            token = getattr(params, "kvplane_token", "0" * 32)
            arm(attacker, prefill)
            ask(attacker, cmd="connect", port=prefill.side.port, name="probe")  # answered handshake or refusal
            before = status_mib("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the RSS now
            message = heartbeat("known", "evil", token, times=MAX_HEARTBEAT_IDS)
            started = time.monotonic()
            ask(attacker, cmd="send", name="evil", count=a.messages, message=message)
            waits = []
            while True:  # the probe's handshakes until the flood's connection answers its own, sent after the flood
                t = time.monotonic()
                assert ask(attacker, cmd="handshake", name="probe", engine_id="probe", within=120)["reply"] != "none"
                waits.append(time.monotonic() - t)
                t = time.monotonic()
                if ask(attacker, cmd="handshake", name="evil", engine_id="evil", within=0.05)["reply"] != "none":
                    break
            drained = time.monotonic() - started
            peak, after = status_mib("VmHWM"), status_mib("VmRSS")
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # what glibc kept of the freed memory goes back to the kernel
            trimmed = status_mib("VmRSS")
            received = len(__import__("msgspec").msgpack.encode(message)) * a.messages / 2**20
            print(f"{a.messages} heartbeats of {MAX_HEARTBEAT_IDS} ids ({received:.0f} MiB received) drained in "
                  f"{drained:.2f} s; probe handshakes answered {len(waits)} times, longest wait {max(waits):.3f} s, "
                  f"median {sorted(waits)[len(waits) // 2]:.3f} s")
            print(f"prefill process RSS before {before:.0f} MiB, peak {peak:.0f} MiB (+{peak - before:.0f}), "
                  f"after {after:.0f} MiB (+{after - before:.0f}), after malloc_trim {trimmed:.0f} MiB "
                  f"(+{trimmed - before:.0f})")
            pull_and_check(prefill, decode, "after")
        finally:
            attacker.kill()
            decode.close()
            prefill.close()


if __name__ == "__main__":
    main()
