"""Native-backed memory API (placeholder until written)."""

__all__: list[str] = []
