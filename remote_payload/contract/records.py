"""The typed records results.json is read into (results.py holds the schema): `doc(...)` fields that carry their
documentation, `Record` (strict `from_dict`, unknown fields kept in `extra`, `to_dict`), and the strict
conversion of JSON values to the declared types, a `ResultsError` naming the field otherwise.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


class ResultsError(ValueError):
    """A results.json that breaks the schema (one line: the file, the field, what is wrong)."""


def doc(text: str, default: Any = MISSING, factory: Any = MISSING) -> Any:
    """A schema field with its documentation (docs/results.md); a default makes it optional."""
    if factory is not MISSING:
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(kw_only=True)
class Record:
    """Base of every schema object: unknown fields of the file are kept in `extra` (and written back)."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, metadata={"internal": True})

    @classmethod
    def from_dict(cls, d: Any, where: str = ""):
        return record_from_dict(cls, d, where or cls.__name__)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: _dump(getattr(self, f.name)) for f in fields(self) if not f.metadata.get("internal")}
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "object"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"object of {_type_name(typing.get_args(tp)[1])}"
    return {str: "string", int: "integer", float: "number", bool: "true/false", type(None): "null",
            Any: "any"}.get(tp, getattr(tp, "__name__", str(tp)))


def _bad(where: str, tp: Any, v: Any) -> ResultsError:
    shown = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return ResultsError(f"field {where}: expected {_type_name(tp)}, got {shown[:40]}")


# a number is finite: NaN / Infinity (json.loads reads them) are no number; where null is allowed they read as null
_SCALARS = {float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
            int: lambda x: isinstance(x, int) and not isinstance(x, bool),
            bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str)}


def _convert(tp: Any, v: Any, where: str) -> Any:
    if tp is Any:
        return v
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if v is None and type(None) in args:
            return None
        if type(None) in args and isinstance(v, float) and not math.isfinite(v):
            return None  # NaN / Infinity: missing (never in a table, a CI or --format json)
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported schema type {tp}")
        if inner[0] in _SCALARS and not _SCALARS[inner[0]](v):
            raise _bad(where, tp, v)  # "expected number or null"
        return _convert(inner[0], v, where)
    if dataclasses.is_dataclass(tp):
        return record_from_dict(tp, v, where)
    if origin is list:
        if not isinstance(v, list):
            raise _bad(where, tp, v)
        (item,) = typing.get_args(tp)
        return [_convert(item, x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise _bad(where, tp, v)
        _, item = typing.get_args(tp)
        return {str(k): _convert(item, x, f"{where}.{k}") for k, x in v.items()}
    ok = _SCALARS.get(tp)
    if ok is None:
        raise TypeError(f"unsupported schema type {tp}")
    if not ok(v):
        raise _bad(where, tp, v)
    return v


def record_from_dict(cls: type, d: Any, where: str) -> Any:
    if not isinstance(d, dict):
        raise _bad(where or "(top level)", cls, d)
    hints = _hints(cls)
    kw, known = {}, set()
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        known.add(f.name)
        path = f"{where}.{f.name}" if where else f.name
        if f.name in d:
            kw[f.name] = _convert(hints[f.name], d[f.name], path)
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ResultsError(f"missing required field {path}")
    obj = cls(**kw)
    obj.extra = {k: v for k, v in d.items() if k not in known}
    return obj


def _dump(v: Any) -> Any:
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, list):
        return [_dump(x) for x in v]
    if isinstance(v, dict):
        return {k: _dump(x) for k, x in v.items()}
    return v
