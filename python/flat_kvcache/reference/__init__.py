"""Pure-Python reference implementation of flat-kvcache.

Written plainly for readers and used by the tests to cross-check the native (Rust) code. It
imports nothing native except the build flag (``flat_kvcache._native.FLAT_KVCACHE``).
Each submodule defines ``__all__``; this package re-exports all of them, so
``flat_kvcache.reference`` offers the same names as ``flat_kvcache``.
"""

from flat_kvcache.reference.engine import *  # noqa: F403
from flat_kvcache.reference.engine import __all__ as _engine_all
from flat_kvcache.reference.memory import *  # noqa: F403
from flat_kvcache.reference.memory import __all__ as _memory_all
from flat_kvcache.reference.sizing import *  # noqa: F403
from flat_kvcache.reference.sizing import __all__ as _sizing_all

__all__ = [*_sizing_all, *_memory_all, *_engine_all]
