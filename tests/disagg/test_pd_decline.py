"""A decode that will never receive a request (its client went away before the engine scheduled it) declines it:
the prefill ranks holding its blocks free them at once instead of at the end of their lease, and the decline
counts only with the request's token. Real sides on 127.0.0.1, a lease far longer than the test may wait."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pair import Engine, make, push_params, small_spec, token_for

LONG: dict[str, Any] = {"lease_s": 600.0, "push_timeout_s": 600.0}


@pytest.fixture
def sides() -> Iterator[tuple[Engine, Engine]]:
    spec = small_spec()
    prefill, decode = make("prefill", spec, seed=1, **LONG), make("decode", spec, **LONG)
    yield prefill, decode
    decode.close()
    prefill.close()


def test_a_declined_pull_frees_the_prefills_blocks_before_the_lease(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = prefill.side.request_finished("r1", prefill.allocate(40), 40)
    decode.side.decline(params)
    done = prefill.wait("r1", within_s=20.0)  # the lease would hold them for 600 s
    assert done.state == "failed" and "gave the request up" in done.reason
    assert decode.side.pending_requests() == 0 and decode.collect() == {}  # nothing to report on the decode


def test_a_decline_with_another_token_frees_nothing(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = prefill.side.request_finished("r2", prefill.allocate(40), 40)
    forged = params.to_dict() | {"kvplane_token": token_for("someone else")}
    decode.side.decline(forged)
    decode.side.decline(push_params(prefill.side.base_port, "r3", prefill.side.config.engine_id))  # never held
    later = prefill.side.request_finished("r4", prefill.allocate(40), 40)
    decode.side.decline(later)
    assert prefill.wait("r4", within_s=20.0).state == "failed"  # the later, honest decline was taken
    assert "r2" not in prefill.collect()  # the forged one was not


def test_a_push_declined_before_it_registered_frees_the_prefills_blocks(sides: tuple[Engine, Engine]) -> None:
    prefill, decode = sides
    params = push_params(prefill.side.base_port, "r5", prefill.side.config.engine_id)
    prefill.side.request_finished("r5", prefill.allocate(40), 40, token=token_for("r5"))
    decode.side.decline(params)
    assert prefill.wait("r5", within_s=20.0).state == "failed"
