"""Reference memory (placeholder until written)."""

__all__: list[str] = []
