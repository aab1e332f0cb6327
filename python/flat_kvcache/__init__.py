"""flat-kvcache: a Rust-backed paged KV-cache page manager for hybrid-attention LLM serving.

One page-id space is shared by every attention group of a model (full attention, sliding
window, linear-attention state). Sizing formulas, memory plans, the page pool and the hybrid
coordinator run in Rust with checked arithmetic; :mod:`flat_kvcache.reference` is an
independent pure-Python implementation of the same behaviour.

Public names come from the submodules, one concern each: :mod:`flat_kvcache.sizing`
(SPEC 2), :mod:`flat_kvcache.memory` (SPEC 3), :mod:`flat_kvcache.engine` (SPEC 4-8), and the
exception classes both engines raise, :mod:`flat_kvcache.errors`. From a model config (a preset
name, a ``config.json`` path or a dict) to the engine in one call: :func:`cache_from_config`
(:mod:`flat_kvcache.config`).
"""

from flat_kvcache import _native
from flat_kvcache.config import cache_from_config
from flat_kvcache.engine import *  # noqa: F403
from flat_kvcache.engine import __all__ as _engine_all
from flat_kvcache.errors import *  # noqa: F403
from flat_kvcache.errors import __all__ as _errors_all
from flat_kvcache.memory import *  # noqa: F403
from flat_kvcache.memory import __all__ as _memory_all
from flat_kvcache.sizing import *  # noqa: F403
from flat_kvcache.sizing import __all__ as _sizing_all

__version__: str = _native.__version__
#: True when the native module was built with the ``flat`` cargo feature (the default).
FLAT_KVCACHE: bool = bool(_native.FLAT_KVCACHE)

__all__ = [
    "FLAT_KVCACHE",
    "__version__",
    "cache_from_config",
    *_sizing_all,
    *_memory_all,
    *_engine_all,
    *_errors_all,
]
