"""Which instance gets the next request: round-robin or least outstanding requests, over the healthy ones.

``InstancePool`` keeps, per instance, whether it is up (health checks and failed connections say so) and how
many requests it is serving. ``lease`` picks one and counts it until the request ends, on every path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvplane.proxy.config import Instance, Policy
from kvplane.proxy.errors import ProxyError


class InstancePool:
    def __init__(self, instances: tuple[Instance, ...], policy: Policy) -> None:
        self.instances = instances
        self.policy = policy
        self.up = {inst.url: True for inst in instances}
        self.outstanding = {inst.url: 0 for inst in instances}
        self._next = 0

    def pick(self) -> Instance:
        n = len(self.instances)
        order = [self.instances[(self._next + i) % n] for i in range(n)]
        healthy = [inst for inst in order if self.up[inst.url]]
        if not healthy:
            role = self.instances[0].role
            raise ProxyError(503, f"no_{role}", f"no {role} instance is up ({', '.join(self.up)} failed their "
                                                f"health checks); check them with GET /health")
        if self.policy == "least-outstanding":
            chosen = min(healthy, key=lambda inst: self.outstanding[inst.url])  # ties: round-robin order
        else:
            chosen = healthy[0]
        self._next = (self.instances.index(chosen) + 1) % n
        return chosen

    @contextmanager
    def lease(self) -> Iterator[Instance]:
        inst = self.pick()
        self.outstanding[inst.url] += 1
        try:
            yield inst
        finally:
            self.outstanding[inst.url] -= 1

    def mark(self, inst: Instance, up: bool) -> bool:
        """Record a health result; True when it changed."""
        changed = self.up[inst.url] != up
        self.up[inst.url] = up
        return changed
