"""The frozen-dataclass base of every config: field type checks, replace, to_dict, from_dict.

Framework-free: torch_ref builds its modules from the very same config objects.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _probability(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")



def _type_name(t: type) -> str:
    if t is type(None):
        return "None"
    return f"{'an' if t.__name__[0] in 'aeiou' else 'a'} {t.__name__}"


class _Config:
    """Type checking and replace / to_dict / from_dict shared by the frozen config dataclasses.

    ``__post_init__`` checks every field against its annotation before the subclass's
    ``_validate`` checks ranges, so a new field is type-checked without extra code. Ints are
    accepted for float fields (and stored as floats); bool is not accepted as an int.
    """

    @classmethod
    @functools.cache
    def field_types(cls) -> dict[str, tuple[type, ...]]:
        """Field name -> the types its annotation allows (``int | None`` -> (int, NoneType))."""
        hints = typing.get_type_hints(cls)
        out = {}
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            out[f.name] = typing.get_args(t) if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union \
                else (t,)
        return out

    def __post_init__(self) -> None:
        for name, allowed in self.field_types().items():
            value = getattr(self, name)
            if value is None and type(None) in allowed:
                continue
            if isinstance(value, bool) or type(value).__name__ == "bool_":  # bool subclasses int: not a number here
                ok, value = bool in allowed, bool(value)
            elif isinstance(value, numbers.Integral) and (int in allowed or float in allowed):
                ok, value = True, (int if int in allowed else float)(value)
            elif isinstance(value, numbers.Real) and float in allowed:
                ok, value = True, float(value)
                if not math.isfinite(value):
                    raise ValueError(f"{name} must be a finite number, got {value!r}")
            else:
                ok = any(t not in (int, float, bool) and isinstance(value, t) for t in allowed)
            if not ok:
                expected = " or ".join(_type_name(t) for t in allowed)
                raise ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, value)  # frozen: normalise 1 -> 1.0, np.int64 -> int
        self._validate()

    def _validate(self) -> None:
        """Ranges and cross-field rules (the types are already checked)."""

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Inverse of ``to_dict``; unknown keys are an error (nested configs override this)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**d)


