"""Reference sizing (placeholder until written)."""

__all__: list[str] = []
