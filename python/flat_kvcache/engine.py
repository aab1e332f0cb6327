"""Native-backed engine API (placeholder until written)."""

__all__: list[str] = []
