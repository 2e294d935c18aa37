"""``kvplane.runtime.Executor``: one named daemon thread running jobs in submission order, exceptions logged once
with the job's name and handed to the future if there is one, an explicit choice at close between running and
dropping what is queued, and no thread left behind."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import KvplaneError
from kvplane.runtime import Executor, ExecutorClosed

WAIT_S = 10.0  # a bound on waits that should end at once; never a timing assertion


class Records(logging.Handler):
    """The ``kvplane.runtime`` log lines of one test (a plain handler, so hypothesis examples can use it)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("kvplane.runtime")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def wait_for_threads(count: int) -> int:
    """``threading.active_count()`` once it is back to ``count`` (a thread ends just after its last job)."""
    done = threading.Event()
    for _ in range(1000):
        if threading.active_count() <= count:
            break
        done.wait(0.01)
    return threading.active_count()


def test_jobs_run_in_submission_order_on_one_named_daemon_thread() -> None:
    executor = Executor("kvplane-test-exec")
    seen: list[tuple[int, str, bool]] = []

    def job(i: int) -> None:
        current = threading.current_thread()
        seen.append((i, current.name, current.daemon))

    for i in range(100):
        if i % 2:
            executor.post(lambda i=i: job(i))
        else:
            executor.submit(lambda i=i: job(i))
    assert executor.close()
    assert seen == [(i, "kvplane-test-exec", True) for i in range(100)]


def test_a_submitted_jobs_result_and_exception_reach_its_future_and_the_error_is_logged_once_by_name(
    records: Records,
) -> None:
    executor = Executor("kvplane-test-exec")
    good = executor.submit(lambda: 42)
    bad = executor.submit(lambda: 1 // 0, name="divide")
    after = executor.submit(lambda: "still running")
    assert good.result(WAIT_S) == 42
    with pytest.raises(ZeroDivisionError):
        bad.result(WAIT_S)
    assert after.result(WAIT_S) == "still running"
    executor.close()
    assert records.lines == ["kvplane-test-exec: job divide raised ZeroDivisionError: integer division or modulo by zero"]


def test_a_posted_job_that_raises_is_logged_with_its_callables_name_and_the_next_job_runs(records: Records) -> None:
    executor = Executor("kvplane-test-exec")

    def save_layer() -> None:
        raise RuntimeError("copy failed")

    executor.post(save_layer)
    assert executor.submit(lambda: "next").result(WAIT_S) == "next"
    executor.close()
    assert len(records.lines) == 1
    assert "kvplane-test-exec" in records.lines[0] and "save_layer" in records.lines[0]
    assert "RuntimeError: copy failed" in records.lines[0]


def test_close_runs_the_queued_jobs_first_by_default() -> None:
    gate = threading.Event()
    executor = Executor("kvplane-test-exec")
    executor.post(gate.wait)
    futures = [executor.submit(lambda i=i: i) for i in range(10)]
    gate.set()
    assert executor.close(timeout_s=WAIT_S)
    assert [f.result(0) for f in futures] == list(range(10))


def test_close_with_discard_pending_drops_the_queued_jobs_and_cancels_their_futures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate, entered = threading.Event(), threading.Event()
    executor = Executor("kvplane-test-exec")
    running = executor.submit(lambda: (entered.set(), gate.wait(WAIT_S))[1])
    assert entered.wait(WAIT_S)
    ran: list[int] = []
    queued = [executor.submit(lambda i=i: ran.append(i)) for i in range(5)]
    executor.post(lambda: ran.append(99))
    with caplog.at_level(logging.WARNING, "kvplane.runtime"):
        ended = executor.close(discard_pending=True, wait=False)
    assert not ended  # the running job holds the thread until it returns
    assert all(f.cancelled() for f in queued)
    with pytest.raises(CancelledError):
        queued[0].result(0)
    assert "6 queued job(s) dropped" in caplog.text
    gate.set()
    assert running.result(WAIT_S) is True  # the job that had started finishes normally
    assert executor.close(timeout_s=WAIT_S)
    assert ran == []


def test_work_handed_over_after_close_is_refused_with_a_message_naming_the_executor_and_the_fix() -> None:
    executor = Executor("kvplane-test-exec", fix="create a new stream")
    executor.close()
    with pytest.raises(ExecutorClosed, match=r"kvplane-test-exec is closed and takes no more work; create a new"):
        executor.submit(lambda: None)
    with pytest.raises(KvplaneError, match="closed"):
        executor.post(lambda: None)
    assert executor.close()  # closing twice is harmless


def test_closing_returns_the_thread_count_to_where_it_was() -> None:
    before = threading.active_count()
    executors = [Executor(f"kvplane-test-exec-{i}") for i in range(5)]
    assert threading.active_count() == before + 5
    for executor in executors:
        executor.post(lambda: None)
        assert executor.close()
    assert threading.active_count() == before


def test_an_executor_dropped_without_close_runs_its_queue_and_ends_its_thread() -> None:
    before = threading.active_count()
    executor = Executor("kvplane-test-exec")
    done: Future[int] = executor.submit(lambda: 7)
    del executor
    assert done.result(WAIT_S) == 7
    assert wait_for_threads(before) == before


def test_a_job_may_close_its_own_executor_without_waiting_on_itself() -> None:
    executor = Executor("kvplane-test-exec")
    closed = executor.submit(lambda: executor.close(timeout_s=WAIT_S))
    assert closed.result(WAIT_S) is False  # its own thread is still running that job
    assert executor.close(timeout_s=WAIT_S)


def test_a_stuck_job_bounds_close_by_its_timeout_and_leaves_a_daemon_behind() -> None:
    gate = threading.Event()
    executor = Executor("kvplane-test-exec")
    executor.post(gate.wait)
    assert executor.close(timeout_s=0.01) is False
    assert executor.alive
    gate.set()
    assert executor.close(timeout_s=WAIT_S)


# a job: ("post" | "submit", raises?)
jobs = st.lists(st.tuples(st.sampled_from(["post", "submit"]), st.booleans()), max_size=30)


@settings(max_examples=60, deadline=None)
@given(plan=jobs, discard=st.booleans())
def test_any_mix_of_jobs_runs_in_order_and_loses_no_exception(plan: list[tuple[str, bool]], discard: bool) -> None:
    handler = Records()
    logger = logging.getLogger("kvplane.runtime")
    logger.addHandler(handler)
    before = threading.active_count()
    try:
        gate = threading.Event()
        executor = Executor("kvplane-test-exec")
        executor.post(gate.wait)  # everything below is queued before any of it runs
        ran: list[int] = []
        futures: dict[int, Future[int]] = {}
        for i, (how, raises) in enumerate(plan):
            def job(i: int = i, raises: bool = raises) -> int:
                ran.append(i)
                if raises:
                    raise ValueError(f"job {i}")
                return i

            if how == "submit":
                futures[i] = executor.submit(job, name=f"job-{i}")
            else:
                executor.post(job, name=f"job-{i}")
        executor.close(discard_pending=discard, wait=False)
        gate.set()
        assert executor.close(timeout_s=WAIT_S)
    finally:
        logger.removeHandler(handler)
    assert threading.active_count() == before
    failing = [i for i, (_, raises) in enumerate(plan) if raises]
    if discard:
        assert ran == [] and all(f.cancelled() for f in futures.values())
        return
    assert ran == list(range(len(plan)))
    assert handler.lines == [f"kvplane-test-exec: job job-{i} raised ValueError: job {i}" for i in failing]
    for i, future in futures.items():
        if i in failing:
            assert isinstance(future.exception(0), ValueError)
        else:
            assert future.result(0) == i


def test_a_posted_wrapper_is_logged_with_the_name_of_the_work_it_wraps(records: Records) -> None:
    def run_task(task: Callable[[], None], steps: int) -> None:
        task()

    def copy_layer() -> None:
        raise OSError("bad address")

    executor = Executor("kvplane-test-exec")
    executor.post(run_task, copy_layer, 1)
    executor.close()
    assert len(records.lines) == 1
    assert "run_task(" in records.lines[0] and "copy_layer)" in records.lines[0]
