"""Exception classes of flat-kvcache, shared by the native engine and the pure-Python reference.

Each class also derives from the builtin exception that the same failure raised before these
classes existed, so ``except RuntimeError`` and ``except KeyError`` keep
working; :class:`FlatKVCacheError` catches every one of them at once. Running out of pages is
not an exception: the calls that need pages return False / None and change nothing (SPEC 1).

Argument errors stay plain builtins: a bad value is a ``ValueError``, a wrong type a
``TypeError``, a size that does not fit the native integer type an ``OverflowError``; each
message names the argument.

This module is pure Python and imports nothing of the package, so the native module can raise
these classes (it imports them on first use) and the reference can raise the very same ones.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "FlatKVCacheError",
    "FlatUnavailableError",
    "InvariantError",
    "ModelConfigError",
    "UnknownRequestError",
]


class FlatKVCacheError(Exception):
    """Base class of every exception this package defines."""


class ConfigError(FlatKVCacheError, RuntimeError):
    """A scheduler / backend configuration that cannot serve flat per-group tables (SPEC 2)."""


class ModelConfigError(ConfigError, ValueError):
    """A model config this library cannot read right (an unsupported family, layout or field
    value): the message names the field, the value and what is supported. Also a ``ValueError``,
    which config errors were before this class existed."""


class FlatUnavailableError(FlatKVCacheError, RuntimeError):
    """Flat per-group block tables were asked of a build without the ``flat`` feature (SPEC 10)."""


class InvariantError(FlatKVCacheError, RuntimeError):
    """``check_invariants()`` found broken bookkeeping (a bug in the engine, never bad input)."""


class UnknownRequestError(FlatKVCacheError, KeyError):
    """A request id that the cache does not hold (never added, or already finished)."""
