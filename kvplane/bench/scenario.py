"""What one bench row is: a name, its kind, and how to run it. The catalog (``kvplane.bench.scenarios``) lists
them; each scenario module only offers a ``scenario(...)`` factory and registers nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.backend.base import Backend
from kvplane.bench.results import BenchResult


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # offload | pd | store | plan | overhead | calls
    run: Callable[[Backend, bool], BenchResult]  # (backend, quick) -> result
    params: dict[str, Any] = field(default_factory=dict)
    # frees what the scenario's module keeps for the next row of its kind (buffers, peers, engines); the runner
    # calls it before a row of another module runs, so a long run holds one module's memory at a time
    release: Callable[[], None] | None = None
