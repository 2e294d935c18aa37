"""Starting ``mooncake_master`` on loopback, for tests and the bench (production runs its own master).

The Mooncake wheel ships the binary inside the ``mooncake`` package (``mooncake/mooncake_master``) and a
``mooncake_master`` console script that execs it; ``KVPLANE_MOONCAKE_MASTER`` overrides both. The master gets
free ports for its RPC and metrics servers, both bound to ``host``, and its log goes to a temporary file whose
tail is quoted when it fails to start.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvplane.flows.offload.errors import MasterError

INSTALL_HINT = (
    "install the Mooncake wheel (`pip install mooncake-transfer-engine-non-cuda` on CPU machines, "
    "`mooncake-transfer-engine` with CUDA; never both) or set KVPLANE_MOONCAKE_MASTER to the binary"
)


def find_master_binary() -> str:
    """The ``mooncake_master`` to run: ``$KVPLANE_MOONCAKE_MASTER``, the wheel's own binary, or one on PATH."""
    override = os.environ.get("KVPLANE_MOONCAKE_MASTER")
    if override:
        if not os.access(override, os.X_OK):
            raise MasterError(f"KVPLANE_MOONCAKE_MASTER={override!r} is not an executable file; fix the path")
        return override
    spec = importlib.util.find_spec("mooncake")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    on_path = shutil.which("mooncake_master")
    if on_path:
        return on_path
    raise MasterError(f"mooncake_master was not found (no `mooncake` package with the binary, none on PATH); {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (TIME_WAIT leftovers do not count, as for the master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class MooncakeMaster:
    """A running ``mooncake_master``; ``address`` is what ``StoreConfig.master_address`` takes."""

    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int, log_path: Path) -> None:
        self.process, self.host, self.port, self.log_path = process, host, port, log_path

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests of a store that goes away)."""
        if self.alive():
            self.process.kill()
        self.process.wait(10)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_master(
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    binary: str | None = None,
    startup_timeout_s: float = 15.0,
    extra_args: Sequence[str] = (),
) -> MooncakeMaster:
    """Start ``mooncake_master`` listening on ``host:port`` (a free port when None) and wait until it accepts."""
    exe = binary or find_master_binary()
    attempts = 3 if port is None else 1
    error = ""
    for _ in range(attempts):  # a free port can be taken between choosing it and the master binding it
        rpc_port = port if port is not None else free_port(host)
        if port_taken(host, rpc_port):
            # the master would fail to bind while the readiness probe below connects to whoever holds the port
            error = f"port {rpc_port} on {host} is already in use"
            if port is not None:
                raise MasterError(
                    f"mooncake_master cannot listen on {host}:{port}: the port is already in use; stop what holds "
                    f"it, or pass port=None to pick a free one"
                )
            continue
        fd, name = tempfile.mkstemp(prefix="kvplane-mooncake-master-", suffix=".log")
        log_path = Path(name)
        cmd = [
            exe, f"-rpc_address={host}", f"-rpc_port={rpc_port}", f"-metrics_host={host}",
            f"-metrics_port={free_port(host)}", "-logtostderr", *extra_args,
        ]
        try:
            process = subprocess.Popen(cmd, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL)
        except OSError as e:
            os.close(fd)
            raise MasterError(f"running {exe} failed: {e}; {INSTALL_HINT}") from e
        os.close(fd)
        master = MooncakeMaster(process, host, rpc_port, log_path)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline and master.alive():
            try:
                socket.create_connection((host, rpc_port), timeout=0.2).close()
                return master
            except OSError:
                time.sleep(0.05)
        if master.alive():
            error = f"it did not accept connections on {master.address} within {startup_timeout_s} s"
        else:
            error = f"it exited with code {process.returncode}"
        error += f"; its log ends:\n{master.log_tail()}"
        master.stop()
    raise MasterError(f"mooncake_master ({exe}) did not start: {error}")
