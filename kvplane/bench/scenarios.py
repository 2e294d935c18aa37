"""The scenario registry. A scenario module calls ``register``; the runner picks by name or default set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.backend.base import Backend
from kvplane.bench.results import BenchResult
from kvplane.errors import KvplaneError


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str
    run: Callable[[Backend, bool], BenchResult]  # (backend, quick) -> result
    params: dict[str, Any] = field(default_factory=dict)
    default: bool = True  # part of a plain ``kvplane bench`` run


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> None:
    if scenario.name in SCENARIOS:
        raise KvplaneError(f"bench scenario {scenario.name!r} is registered twice")
    SCENARIOS[scenario.name] = scenario


def load_all() -> dict[str, Scenario]:
    """Import every scenario module (each registers on import) and return the registry."""
    from kvplane.bench import local_copy, offload, pd, pd_flow, plan_build, store  # noqa: F401

    return SCENARIOS


def select(names: list[str] | None) -> list[Scenario]:
    scenarios = load_all()
    if not names:
        return [s for s in scenarios.values() if s.default]
    unknown = [n for n in names if n not in scenarios]
    if unknown:
        raise KvplaneError(f"--scenario {unknown[0]!r} is unknown; choose from: {', '.join(scenarios)}")
    return [scenarios[n] for n in names]
