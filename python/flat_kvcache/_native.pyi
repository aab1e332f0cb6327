"""Type stubs for the native extension `flat_kvcache._native` (hand-written)."""

__version__: str
FLAT_KVCACHE: bool
