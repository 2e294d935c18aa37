"""Configs built from plain data (an engine's JSON): ``msgspec.convert`` into frozen dataclasses, one error shape.

``build(cls, raw, what=..., error=...)`` checks that every key names a field (nested dataclasses too), converts
with msgspec (types, ``Literal`` choices, required fields) and runs the dataclass's ``__post_init__``. Whatever
is wrong comes back as ``error`` naming the source, the path of the field (``$.offload.host_bytes``), the value,
what was expected, and the choices of an enumerated field. A ``__post_init__`` that raises ``invalid(...)``
lets the error name the exact field of a range check.

Used by ``OffloadConfig``/``StoreConfig`` (``flows/offload/config.py``), ``DisaggConfig.from_dict``
(``flows/disagg/wire/config.py``) and the connector's config (``integrations/vllm/config.py``).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import msgspec

T = TypeVar("T")
E = TypeVar("E", bound=Exception)

_AT = re.compile(r"^(?P<reason>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_SEGMENT = re.compile(r"\.(\w+)|\[(\d+)\]")
_MISSING = re.compile(r"^Object missing required field `(\w+)`$")


def invalid(error: type[E], owner: str, name: str, value: Any, problem: str) -> E:
    """The error a ``__post_init__`` raises for one field; ``build`` re-words it with the field's full path."""
    exc = error(f"{owner}.{name}={value!r} {problem}")
    exc.config_field = (name, value, problem)  # type: ignore[attr-defined]
    return exc


def check_keys(cls: Any, raw: Mapping[str, Any], what: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the keys of ``raw`` that are not fields of the dataclass ``cls``, and the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise error(f"{what} has unknown key(s) {unknown}; kvplane knows {sorted(known)}")


def build(cls: type[T], raw: Any, *, what: str, error: type[Exception], path: str = "$") -> T:
    """``raw`` converted to the dataclass ``cls``; ``error`` naming the path, the value and the fix if it cannot be."""
    _check_unknown(cls, raw, what, error, path)
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as e:
        raise error(f"{what}: {_describe(cls, raw, e, path)}") from e


def _dataclass_in(hint: Any) -> Any:
    """The dataclass a field's type holds (``StoreConfig | None`` -> ``StoreConfig``), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}


def _check_unknown(cls: Any, raw: Any, what: str, error: type[Exception], path: str) -> None:
    if not dataclasses.is_dataclass(cls) or not isinstance(raw, Mapping):
        return  # msgspec says what was expected instead
    check_keys(cls, raw, f"{what}: {path}", error)
    for name, hint in _hints(cls).items():
        inner = _dataclass_in(hint)
        if inner is not None and isinstance(raw.get(name), Mapping):
            _check_unknown(inner, raw[name], what, error, f"{path}.{name}")


def _walk(cls: Any, raw: Any, segments: list[str]) -> tuple[Any, Any]:
    """The type and the raw value at ``segments`` below ``cls``/``raw`` (None where it cannot be followed)."""
    hint: Any = cls
    for segment in segments:
        container = _dataclass_in(hint)
        hint = _hints(container).get(segment) if container is not None else None
        raw = raw.get(segment) if isinstance(raw, Mapping) else None
    return hint, raw


def _choices(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(c for arg in typing.get_args(hint) for c in _choices(arg))
    return ()


def _describe(cls: Any, raw: Any, e: msgspec.ValidationError, root: str) -> str:
    match = _AT.match(str(e))
    reason, where = (match["reason"], match["path"]) if match else (str(e), "")
    segments = [name or index for name, index in _SEGMENT.findall(where)]
    field = getattr(e.__cause__, "config_field", None)
    if field is not None:  # a range check of __post_init__, which names its field
        name, value, problem = field
        return f"{root}{where}.{name}={value!r} {problem}"
    missing = _MISSING.match(reason)
    if missing:
        return f"{root}{where}.{missing[1]} is required and missing"
    if e.__cause__ is not None:  # a check of __post_init__ that names no single field
        return f"{root}{where}: {reason}"
    hint, value = _walk(cls, raw, segments)
    choices = _choices(hint)
    fix = f"; choose one of {list(choices)}" if choices else ""
    return f"{root}{where}={value!r}: {reason[0].lower()}{reason[1:]}{fix}"
