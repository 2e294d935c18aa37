"""The proxy's health and retry decisions as pure functions and small state machines, without sockets: when an
instance leaves rotation and comes back, which instance gets a request while none of its role is up, when a
decode's answer is a transfer fault that ``--on-transfer-failure retry-plain`` retries, and the flags.
"""

from __future__ import annotations

import argparse

import pytest

from kvplane.proxy import Instance, ProxyConfig
from kvplane.proxy.cli import add_arguments, config_from
from kvplane.proxy.errors import ProxyConfigError
from kvplane.proxy.flows import is_transfer_fault
from kvplane.proxy.legs import first_event_error
from kvplane.proxy.pool import InstancePool, after_check

A, B, C = (Instance.parse(f"http://10.0.0.{i}:8200", "decode") for i in (1, 2, 3))


def test_an_instance_leaves_rotation_only_after_the_threshold_of_consecutive_failed_checks() -> None:
    up, failures, seen = True, 0, []
    for ok in (False, False, True, False, False, False, False, True):
        up, failures = after_check(up, failures, ok, 3)
        seen.append(up)
    # a success in between starts the count again; the third failure in a row takes it out, a success puts it back
    assert seen == [True, True, True, True, True, False, False, True]


def test_a_threshold_of_one_takes_it_out_at_the_first_failed_check() -> None:
    assert after_check(True, 0, False, 1) == (False, 1)
    assert after_check(False, 7, True, 1) == (True, 0)


def test_an_instance_taken_out_by_a_request_stays_out_until_a_check_passes() -> None:
    pool = InstancePool((A, B), "round-robin", health_failures=3)
    assert pool.failed(A, out=True) and not pool.up[A.url]  # connection refused: out at once
    assert not pool.checked(A, False) and not pool.up[A.url]  # a failed check keeps it out
    assert pool.checked(A, True) and pool.up[A.url]  # the next success puts it back
    assert not pool.checked(A, False) and pool.up[A.url]  # and the count starts again from zero


def test_the_pool_reports_a_change_of_rotation_only_when_the_threshold_is_crossed() -> None:
    pool = InstancePool((A,), "round-robin", health_failures=2)
    assert [pool.checked(A, False), pool.checked(A, False), pool.checked(A, False), pool.checked(A, True)] == \
        [False, True, False, True]


def test_a_request_that_fails_does_not_count_as_a_failed_health_check() -> None:
    pool = InstancePool((A,), "round-robin", health_failures=2)
    assert not pool.failed(A)  # a 500: no change of rotation
    assert not pool.checked(A, False) and pool.up[A.url]  # one failed check of two


def test_a_role_with_none_up_still_gets_its_request_on_the_least_recently_failed_instance() -> None:
    pool = InstancePool((A, B, C), "round-robin", health_failures=1)
    for inst in (B, C, A):  # B failed first, A last
        pool.checked(inst, False)
    assert pool.pick() == B
    pool.failed(B)  # it failed the request too: now the most recent
    assert pool.pick() == C
    pool.failed(C, out=True)
    assert pool.pick() == A


def test_least_outstanding_with_none_up_also_goes_by_the_least_recently_failed() -> None:
    pool = InstancePool((A, B), "least-outstanding", health_failures=1)
    pool.checked(A, False)
    pool.checked(B, False)
    pool.outstanding[A.url] = 5
    assert pool.pick() == A


def test_a_single_instance_that_is_out_is_picked_not_refused() -> None:
    pool = InstancePool((A,), "round-robin", health_failures=1)
    pool.failed(A, out=True)
    with pool.lease() as inst:
        assert inst == A and pool.outstanding[A.url] == 1
    assert pool.outstanding[A.url] == 0


def test_instances_in_rotation_are_preferred_to_those_out_of_it() -> None:
    pool = InstancePool((A, B, C), "round-robin", health_failures=1)
    pool.checked(A, False)
    assert {pool.pick().url for _ in range(4)} == {B.url, C.url}


def test_avoid_skips_the_failed_instance_while_another_is_up_and_uses_it_when_it_is_the_only_one_up() -> None:
    pool = InstancePool((A, B), "round-robin", health_failures=1)
    assert [pool.pick(avoid=A.url) for _ in range(3)] == [B, B, B]
    pool.checked(B, False)
    assert pool.pick(avoid=A.url) == A  # the only one up: it answered, so a plain request may well succeed there
    pool.checked(A, False)
    pool.checked(B, False)  # none up: A failed less recently, but it is avoided while another is left
    assert pool.pick(avoid=A.url) == B
    assert InstancePool((A,), "round-robin").pick(avoid=A.url) == A


def test_acquire_and_release_count_outstanding_requests() -> None:
    pool = InstancePool((A, B), "least-outstanding")
    first = pool.acquire()
    assert pool.acquire() != first  # the other is idle
    pool.release(first)
    assert pool.outstanding[first.url] == 0


@pytest.mark.parametrize("had_params,status,fault", [
    (True, 500, True), (True, 503, True), (True, 599, True),
    (True, 400, False), (True, 404, False), (True, 200, False), (True, 0, False),
    (False, 500, False),  # a plain request (decode-only fallback, or the retry itself) is never retried
])
def test_a_transfer_fault_is_a_5xx_answer_to_a_request_that_carried_kv_transfer_params(
        had_params: bool, status: int, fault: bool) -> None:
    assert is_transfer_fault(had_params, status) is fault


VLLM_ERROR = (b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
              b'"param": null, "code": 500}}\n\n')


@pytest.mark.parametrize("first,code", [
    (VLLM_ERROR, 500),  # vLLM's streamed completions when a KV load failed
    (VLLM_ERROR + b"data: [DONE]\n\n", 500),
    (VLLM_ERROR.replace(b"\n\n", b"\r\n\r\n"), 500),
    (VLLM_ERROR.replace(b"500", b"400"), 400),
    (b'data: {"id": "x", "choices": [{"text": "hi"}]}\n\n' + VLLM_ERROR, 0),  # not the first event
    (VLLM_ERROR[:40], 0),  # an event not complete yet
    (b"data: [DONE]\n\n", 0),
    (b"data: not json\n\n", 0),
    (b'data: {"error": "text"}\n\n', 0),
    (b'data: {"error": {"code": "500"}}\n\n', 0),
    (b"", 0),
])
def test_the_first_event_of_a_stream_is_read_as_an_error_code_only_when_it_is_a_complete_error_event(
        first: bytes, code: int) -> None:
    assert first_event_error(first) == code


def parse(*argv: str) -> ProxyConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from(p.parse_args(["--prefill", "http://10.0.0.7:8100", "--decode", "http://10.0.0.8:8200",
                                     *argv]))


def test_the_health_and_retry_flags_and_their_defaults() -> None:
    c = parse()
    assert (c.health_failures, c.health_timeout_s, c.on_transfer_failure) == (3, 5.0, "error")
    assert c == ProxyConfig(prefill=c.prefill, decode=c.decode)  # the flags' defaults are the config's
    c = parse("--health-failures", "1", "--health-timeout", "0.5", "--on-transfer-failure", "retry-plain")
    assert (c.health_failures, c.health_timeout_s, c.on_transfer_failure) == (1, 0.5, "retry-plain")


@pytest.mark.parametrize("kw,words", [
    ({"health_failures": 0}, "--health-failures 0"),
    ({"health_timeout_s": 0.0}, "health_timeout_s"),
    ({"on_transfer_failure": "retry"}, "--on-transfer-failure 'retry'"),
])
def test_a_bad_health_or_retry_setting_is_refused_naming_it(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ProxyConfigError, match=words):
        ProxyConfig(prefill=(A,), decode=(B,), **kw)  # type: ignore[arg-type]
