"""Which instance gets the next request, and whether each instance is in rotation.

``InstancePool`` keeps, per instance, whether it is up (in rotation), how many health checks in a row it has
failed, when it last failed (a health check or a request: a sequence number, not a clock) and how many requests
it is serving. An instance leaves rotation after ``health_failures`` failed checks in a row (``after_check``), or
at once when a request cannot connect to it; one passing check puts it back.

``pick`` chooses among the instances in rotation: round-robin, least outstanding requests (ties in round-robin
order), or kv-aware: the highest ``kv_cost.value`` of the router's weighted hit tokens (``scores``) and the
outstanding requests; without scores (the router serves by load) kv-aware is least outstanding. While none of the
role is up it does not refuse: it picks the least recently failed instance, so a sole
instance that answers its health checks late still gets the request, and only the request's own failure is
answered. ``lease`` (or ``acquire`` then ``release``) counts the request on the instance until it ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvplane.proxy.config import Instance, Policy
from kvplane.proxy.kv_cost import value

Scores = dict[str, float]  # weighted hit tokens per instance URL (router.py)


def after_check(up: bool, failures: int, ok: bool, threshold: int) -> tuple[bool, int]:
    """An instance's (in rotation, failed checks in a row) after one health check: a pass puts it back at once; the
    ``threshold``-th failure in a row takes it out. An instance already out (a request could not connect) stays out
    until a check passes."""
    if ok:
        return True, 0
    failures += 1
    return up and failures < threshold, failures


class InstancePool:
    def __init__(self, instances: tuple[Instance, ...], policy: Policy, health_failures: int = 3) -> None:
        self.instances = instances
        self.policy = policy
        self.health_failures = health_failures
        self.up = {inst.name: True for inst in instances}
        self.failures = {inst.name: 0 for inst in instances}  # failed health checks in a row
        self.failed_at = {inst.name: 0 for inst in instances}  # the sequence number of its last failure, 0: never
        self.outstanding = {inst.name: 0 for inst in instances}
        self._failures_seen = 0
        self._next = 0

    def pick(self, avoid: str = "", scores: Scores | None = None) -> Instance:
        """The next instance. ``avoid`` (an ``Instance.name``) is skipped while another instance of the pool is a candidate: in
        rotation, or, with none up, any other. ``scores`` count with ``--policy kv-aware`` only."""
        n = len(self.instances)
        order = [self.instances[(self._next + i) % n] for i in range(n)]
        healthy = [inst for inst in order if self.up[inst.name]]
        candidates = [inst for inst in healthy or order if inst.name != avoid] or healthy or order
        if not healthy:  # none up: still sent, to the least recently failed (ties: round-robin order)
            chosen = min(candidates, key=lambda inst: self.failed_at[inst.name])
        elif self.policy == "kv-aware" and scores is not None:
            chosen = max(candidates, key=lambda inst: (value(scores.get(inst.name, 0.0), self.outstanding[inst.name]),
                                                       -self.outstanding[inst.name]))  # ties: round-robin order
        elif self.policy in ("least-outstanding", "kv-aware"):
            chosen = min(candidates, key=lambda inst: self.outstanding[inst.name])  # ties: round-robin order
        else:
            chosen = candidates[0]
        self._next = (self.instances.index(chosen) + 1) % n
        return chosen

    def acquire(self, avoid: str = "", scores: Scores | None = None) -> Instance:
        """``pick``, counted as outstanding until ``release``."""
        inst = self.pick(avoid, scores)
        self.outstanding[inst.name] += 1
        return inst

    def release(self, inst: Instance) -> None:
        self.outstanding[inst.name] -= 1

    @contextmanager
    def lease(self, avoid: str = "", scores: Scores | None = None) -> Iterator[Instance]:
        inst = self.acquire(avoid, scores)
        try:
            yield inst
        finally:
            self.release(inst)

    def checked(self, inst: Instance, ok: bool) -> bool:
        """Record a health check's result; True when the instance entered or left rotation."""
        if not ok:
            self._failed(inst)
        was = self.up[inst.name]
        self.up[inst.name], self.failures[inst.name] = after_check(was, self.failures[inst.name], ok,
                                                                 self.health_failures)
        return self.up[inst.name] != was

    def failed(self, inst: Instance, out: bool = False) -> bool:
        """Record a request that failed on the instance; ``out`` (it could not connect) takes it out of rotation at
        once. True when it left rotation."""
        self._failed(inst)
        was = self.up[inst.name]
        if out:
            self.up[inst.name] = False
        return self.up[inst.name] != was

    def _failed(self, inst: Instance) -> None:
        self._failures_seen += 1
        self.failed_at[inst.name] = self._failures_seen
