"""flat-kvcache: a Rust-backed paged KV-cache page manager for hybrid-attention LLM serving.

One page-id space is shared by every attention group of a model (full attention, sliding
window, linear-attention state). Sizing formulas, memory plans, the page pool and the hybrid
coordinator run in Rust with checked arithmetic; :mod:`flat_kvcache.reference` is an
independent pure-Python implementation of the same behaviour.
"""

from flat_kvcache import _native

__version__: str = _native.__version__
#: True when the native module was built with the ``flat`` cargo feature (the default).
FLAT_KVCACHE: bool = bool(_native.FLAT_KVCACHE)

__all__ = [
    "FLAT_KVCACHE",
    "__version__",
]
