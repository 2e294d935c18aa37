"""Engine output goes to a log file, not the terminal, while the bench runs.

Mooncake logs through glog on its own threads and NIXL/UCX print on stdout from C, and peer processes inherit
the parent's descriptors, so redirecting ``sys.stdout`` is not enough: file descriptors 1 and 2 themselves
point at the log file for the duration, and the bench writes its own output to a duplicate of the terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


@contextmanager
def engine_output_to(path: str) -> Iterator[TextIO]:
    """Point fds 1 and 2 at ``path`` (truncated); yield a text stream on the original stdout."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    terminal = os.fdopen(os.dup(saved_out), "w", buffering=1)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield terminal
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)
        terminal.close()
