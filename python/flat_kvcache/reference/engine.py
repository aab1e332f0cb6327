"""Reference engine (placeholder until written)."""

__all__: list[str] = []
