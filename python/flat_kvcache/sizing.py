"""Native-backed sizing API (placeholder until written)."""

__all__: list[str] = []
