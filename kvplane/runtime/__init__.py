"""Threads that run kvplane's work: ``Executor`` (one named daemon thread draining a FIFO of jobs) and the
``JobQueue`` it drains, which the disaggregation I/O loop drains from its own thread.

The bottom layer beside ``errors``: it imports nothing else of kvplane, and any layer may use it.
"""

from kvplane.runtime.executor import Executor
from kvplane.runtime.jobs import ExecutorClosed, JobQueue

__all__ = ["Executor", "ExecutorClosed", "JobQueue"]
