"""Argument checks shared by the reference modules (docs/sizing-api.md, "Integer arguments").

Integers are plain Python ints, so every formula in the reference is exact at any size. The
native side raises ``OverflowError`` where a value does not fit ``u64``; the reference never does.
"""

from __future__ import annotations

from collections.abc import Mapping

from flat_kvcache._types import as_int

__all__ = ["as_int", "ceil_div", "is_sequence", "non_negative", "positive"]


def non_negative(value: object, name: str) -> int:
    """An int ``>= 0`` (``ValueError("<name> must be >= 0, got <value>")`` otherwise)."""
    number = as_int(value, name)
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return number


def positive(value: object, name: str) -> int:
    """An int ``> 0`` (``ValueError("<name> must be > 0, got <value>")`` otherwise)."""
    number = as_int(value, name)
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {number}")
    return number


def ceil_div(numerator: int, denominator: int) -> int:
    """Exact ``ceil(numerator / denominator)`` for ``denominator > 0`` (the SPEC glossary's ``ceil``)."""
    return -(-numerator // denominator)


def is_sequence(value: object) -> bool:
    """True for an indexable container with a length that is not a mapping (list, tuple, 1-D array).

    Strings pass too; callers that must refuse a bare ``str`` check for it first. A 0-d numpy
    array has ``__len__`` on its type but no length, so it is not a sequence (it is an int).
    """
    if isinstance(value, Mapping) or not hasattr(type(value), "__getitem__"):
        return False
    try:
        len(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
