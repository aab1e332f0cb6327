"""Which state checkpoints a cache keeps and where it writes them (SPEC 13.8; the native
``engine/policy.rs``).

``lru`` keeps every checkpoint SPEC 13.5 writes until the pool evicts it (13.7): a
checkpoint at ``t`` serves every later prompt that shares at least ``t`` tokens with it,
wherever that prompt diverges after ``t``, so no checkpoint is dropped on a guess of where
prompts will diverge. ``reuse`` adds, from what the cache sees:

- the sharing grain ``S``: the largest ``G * 2**k`` (``k <= MAX_LEVEL``) dividing at least 90 %
  of the divergence points seen (a full-attention match that stopped before the capped prompt),
  once ``MIN_OBSERVATIONS`` were seen; else the state grain ``G``;
- the body's end on ``S`` (SPEC 13.5b with ``S``; ``G`` when no multiple of ``S`` lies ahead),
  written until ``MIN_OBSERVATIONS`` were written, then while the prompts resumed at body ends
  per body end written are at least those resumed at finish checkpoints per finish checkpoint
  left (SPEC 13.8b: a body end serves only prompts diverging before the finish checkpoint);
- at a request's finish, its finish checkpoint and each of its chunk ends (a prompt checkpoint
  other than its body end and branch point) still cached are kept until ``MIN_OBSERVATIONS``
  of that role were kept, then while hits per checkpoint of that role kept are at least hits
  per body end written; otherwise released (SPEC 13.8b);
- whole hybrid prefixes (``prefixes.py``): full-attention pages on no cached checkpoint's path
  lose their keys.
"""

from __future__ import annotations

__all__ = [
    "BODY",
    "CHUNK",
    "EVICTION_POLICIES",
    "FINISH",
    "MAX_LEVEL",
    "MIN_OBSERVATIONS",
    "OTHER",
    "ReuseEvidence",
]

#: Divergence points needed before the sharing grain moves from ``G``.
MIN_OBSERVATIONS = 16
#: The largest sharing grain is ``G * 2**MAX_LEVEL``.
MAX_LEVEL = 6
#: What a checkpoint was written as, for the body-end rule (SPEC 13.8b).
BODY, FINISH, CHUNK, OTHER = "body", "finish", "chunk", "other"
#: The ``eviction_policy`` names.
EVICTION_POLICIES = ("lru", "reuse")


def _pays(count: int, hits: int, ref_count: int, ref_hits: int) -> bool:
    """The rule every role of SPEC 13.8b follows: a role is kept (written) until
    ``MIN_OBSERVATIONS`` of it were counted, then while prompts resume at it per checkpoint
    (``hits / count``) at least as often as at the role it is compared with (``ref_hits /
    ref_count``), cross-multiplied."""
    return count < MIN_OBSERVATIONS or hits * ref_count >= ref_hits * count


class ReuseEvidence:
    """Where prompts diverge, and where they resume, as the ``reuse`` policy saw it so far."""

    def __init__(self) -> None:
        self.seen = 0
        #: Of the divergence points seen, the multiples of ``G * 2**k``, ``k = 0..MAX_LEVEL``.
        self.multiples = [0] * (MAX_LEVEL + 1)
        #: The state pages whose checkpoint is a prompt's body end (SPEC 13.5b, ``BODY``), a chunk
        #: end (13.5a, ``CHUNK``) or a request's finish checkpoint (13.5d, ``FINISH``).
        self.roles: dict[int, str] = {}
        #: Body ends written and prompts that resumed at one; finish checkpoints the same.
        self.body_written = 0
        self.body_hits = 0
        self.finish_written = 0
        self.finish_hits = 0
        #: Chunk-end checkpoints kept at their request's finish, and prompts that resumed at one.
        self.chunk_kept = 0
        self.chunk_hits = 0

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

    def wrote(self, page: int, role: str) -> None:
        """A checkpoint was written on state page ``page`` as ``role`` (``BODY``, ``FINISH``,
        ``CHUNK`` or ``OTHER``: a branch point, a decode checkpoint in flight)."""
        if role == BODY:
            self.body_written += 1
        elif role == FINISH:
            self.finish_written += 1
        elif role == CHUNK:
            pass
        else:
            self.roles.pop(page, None)
            return
        self.roles[page] = role

    def resumed(self, page: int) -> None:
        """An admitted prompt resumed at the checkpoint on state page ``page``."""
        role = self.roles.get(page)
        if role == BODY:
            self.body_hits += 1
        elif role == FINISH:
            self.finish_hits += 1
        elif role == CHUNK:
            self.chunk_hits += 1

    def is_chunk_end(self, page: int) -> bool:
        """Whether the checkpoint on state page ``page`` was written as a chunk end (SPEC 13.8b)."""
        return self.roles.get(page) == CHUNK

    def keep_chunk_end(self) -> bool:
        """At a request's finish, whether one of its chunk-end checkpoints still cached is kept
        (counted as kept) or released (SPEC 13.8b): kept until ``MIN_OBSERVATIONS`` were kept,
        then while a chunk end kept is resumed from at least as often as a body end written."""
        keep = _pays(self.chunk_kept, self.chunk_hits, self.body_written, self.body_hits)
        if keep:
            self.chunk_kept += 1
        return keep

    def keep_finish(self) -> bool:
        """At a request's finish, whether its finish checkpoint, still cached, is kept (then
        :meth:`wrote` counts it as left) or released (SPEC 13.8b): kept until
        ``MIN_OBSERVATIONS`` were left, then while one left is resumed from at least as often as
        a body end written."""
        return _pays(self.finish_written, self.finish_hits, self.body_written, self.body_hits)

    def writes_body_end(self) -> bool:
        """Whether prompts' body ends are checkpointed (SPEC 13.8b): until ``MIN_OBSERVATIONS``
        were written, then while a body end written is resumed from at least as often as a
        finish checkpoint (the request's other checkpoint past its prompt's last sharing-grain
        boundary, which holds the same state memory and serves the prompts that share more)."""
        return _pays(self.body_written, self.body_hits, self.finish_written, self.finish_hits)
