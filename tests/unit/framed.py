"""A child process spoken to in length-prefixed msgpack frames over its stdin and stdout.

The child writes replies to its original stdout and sends everything else that would print there (NIXL, UCX
and Mooncake log to stdout) to stderr, which goes to a log file; a child that dies or stays silent fails the
test with the tail of that log instead of hanging it.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO

import msgspec


def read_frame(stream: BinaryIO) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    return msgspec.msgpack.decode(stream.read(size))


def write_frame(stream: BinaryIO, message: Any) -> None:
    body = msgspec.msgpack.encode(message)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def reply_channel() -> BinaryIO:
    """In the child: the stream replies go to; stdout itself now leads to stderr."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    return replies


class ChildDied(Exception):
    pass


class FramedProcess:
    """``python *argv`` with this module importable in the child (it frames its replies with it)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        here = str(Path(__file__).parent)
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                env={**os.environ, "PYTHONPATH": path, **(env or {})},
            )
        self._pending = b""

    def send(self, **message: Any) -> None:
        body = msgspec.msgpack.encode(message)
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack(">I", len(body)) + body)
        self.proc.stdin.flush()

    def read(self, timeout: float) -> Any:
        head = self._take(4, timeout)
        return msgspec.msgpack.decode(self._take(struct.unpack(">I", head)[0], timeout))

    def ask(self, timeout: float = 60.0, **message: Any) -> Any:
        self.send(**message)
        return self.read(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _take(self, size: int, timeout: float) -> bytes:
        assert self.proc.stdout is not None
        fd, end = self.proc.stdout.fileno(), time.monotonic() + timeout
        while len(self._pending) < size:
            ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                raise ChildDied(
                    f"{self.log.name}: nothing within {timeout} s (exit code {self.proc.poll()}); its log:\n"
                    f"{self.log_tail()}"
                )
            self._pending += chunk
        out, self._pending = self._pending[:size], self._pending[size:]
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="exit")
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
