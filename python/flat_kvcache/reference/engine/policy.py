"""Which state checkpoints a cache keeps (SPEC 13.8; the native ``engine/policy.rs``).

``lru`` keeps every checkpoint SPEC 13.5 writes until the pool evicts it. ``reuse`` keeps a
checkpoint where reuse is likely:

- the sharing grain ``S``: the largest ``G * 2**k`` (``k <= MAX_LEVEL``) dividing at least 90 %
  of the divergence points seen (a full-attention match that stopped before the capped prompt),
  once ``MIN_OBSERVATIONS`` were seen; else the state grain ``G``;
- the body's end on ``S`` (SPEC 13.5b with ``S``; ``G`` when no multiple of ``S`` lies ahead);
- at finish, prompt checkpoints are dropped unless held, except the branch point and the last
  one when it lies on ``S``;
- at finish, the decode checkpoint is kept once a kept one was hit, else only by the ``n``-th
  request that has one for ``n`` a power of two (the probes, backing off while none is hit),
  else dropped unless held.
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
    """What the ``reuse`` policy learned so far."""

    def __init__(self) -> None:
        self.seen = 0
        #: Of the divergence points seen, the multiples of ``G * 2**k``, ``k = 0..MAX_LEVEL``.
        self.multiples = [0] * (MAX_LEVEL + 1)
        self.decode_seen = 0
        self.decode_hits = 0
        #: Kept decode checkpoints: page -> key.
        self.decode_keys: dict[int, str] = {}

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

    def note_hit(self, page: int, key: str) -> None:
        """A prefix hit restored checkpoint ``key`` in ``page``."""
        if self.decode_keys.get(page) == key:
            self.decode_hits += 1

    def keep_decode(self) -> bool:
        """Whether a finishing request keeps its decode checkpoint (counts the request): always
        once a kept one was hit, before that the ``n``-th such request for ``n`` a power of two."""
        self.decode_seen += 1
        return self.decode_hits > 0 or self.decode_seen & (self.decode_seen - 1) == 0

    def kept_decode(self, page: int, key: str) -> None:
        self.decode_keys[page] = key
