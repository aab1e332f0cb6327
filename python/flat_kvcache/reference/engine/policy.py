"""Which state checkpoints a cache keeps and where it writes them (SPEC 13.8; the native
``engine/policy.rs``).

Both policies keep every checkpoint SPEC 13.5 writes until the pool evicts it (13.7): a
checkpoint at ``t`` serves every later prompt that shares at least ``t`` tokens with it,
wherever that prompt diverges after ``t``, so no checkpoint is dropped on a guess of where
prompts will diverge. ``reuse`` adds, from what the cache sees:

- the sharing grain ``S``: the largest ``G * 2**k`` (``k <= MAX_LEVEL``) dividing at least 90 %
  of the divergence points seen (a full-attention match that stopped before the capped prompt),
  once ``MIN_OBSERVATIONS`` were seen; else the state grain ``G``;
- the body's end on ``S`` (SPEC 13.5b with ``S``; ``G`` when no multiple of ``S`` lies ahead);
- whole hybrid prefixes (``prefixes.py``): full-attention pages on no cached checkpoint's path
  lose their keys.
"""

from __future__ import annotations

__all__ = ["EVICTION_POLICIES", "MAX_LEVEL", "MIN_OBSERVATIONS", "ReuseEvidence"]

#: Divergence points needed before the sharing grain moves from ``G``.
MIN_OBSERVATIONS = 16
#: The largest sharing grain is ``G * 2**MAX_LEVEL``.
MAX_LEVEL = 6
#: The ``eviction_policy`` names.
EVICTION_POLICIES = ("lru", "reuse")


class ReuseEvidence:
    """Where prompts diverge, as the ``reuse`` policy saw it so far."""

    def __init__(self) -> None:
        self.seen = 0
        #: Of the divergence points seen, the multiples of ``G * 2**k``, ``k = 0..MAX_LEVEL``.
        self.multiples = [0] * (MAX_LEVEL + 1)

    def observe(self, point: int, grain: int) -> None:
        """Record divergence point ``point`` (tokens, > 0) of a state grain ``grain``."""
        self.seen += 1
        unit = grain
        for k in range(MAX_LEVEL + 1):
            if point % unit:
                break
            self.multiples[k] += 1
            unit *= 2

    def sharing_grain(self, grain: int) -> int:
        """The sharing grain ``S`` of a state grain ``grain``."""
        if self.seen < MIN_OBSERVATIONS:
            return grain
        best = unit = grain
        for count in self.multiples:
            if count * 10 < self.seen * 9:
                break
            best = unit
            unit *= 2
        return best
