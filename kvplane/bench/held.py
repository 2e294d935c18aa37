"""What a scenario module keeps between its rows: one resource (buffers, peers, engines) at a time, keyed by
what built it, so rows of the same model and engine share it and a long run holds one module's memory at once.
The runner releases each module's resource when the next module's rows start; ``release_all`` lets whoever runs
rows another way (a test calling ``Scenario.run``) end with nothing held: no engine left alive past its rows.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")
_ALL: weakref.WeakSet[Held[object]] = weakref.WeakSet()


class Held(Generic[T]):
    def __init__(self, close: Callable[[T], None]) -> None:
        self._close = close
        self._key: Hashable = None
        self._value: T | None = None
        atexit.register(self.release)  # peers are daemons anyway; this closes them politely first
        _ALL.add(self)  # type: ignore[arg-type]

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The held resource if it was built for ``key``; otherwise release it and build a new one."""
        if self._value is not None and self._key == key:
            return self._value
        self.release()
        value = build()
        self._key, self._value = key, value
        return value

    def __bool__(self) -> bool:
        """Whether something is held now."""
        return self._value is not None

    def release(self) -> None:
        value, self._value, self._key = self._value, None, None
        if value is not None:
            self._close(value)


def release_all() -> None:
    """Release what every scenario module holds (rigs, engines, peers)."""
    for held in list(_ALL):
        held.release()
