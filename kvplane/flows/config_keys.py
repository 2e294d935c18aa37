"""Flow configs built from plain data (a connector's JSON): every key must name a field of the config class."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any


def check_keys(cls: Any, raw: Mapping[str, Any], what: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the keys of ``raw`` that are not fields of the dataclass ``cls``, and the known ones."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise error(f"{what} has unknown key(s) {unknown}; known: {sorted(known)}")
