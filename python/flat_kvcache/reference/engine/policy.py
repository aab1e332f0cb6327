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
  left, kept or ghosts (SPEC 13.8b: a body end serves only prompts diverging before the finish
  checkpoint), and at least what an eviction costs: ``H_B >= p_M * min(N_B, E)`` (``p_M`` and
  ``E`` those of the finish rule below; a body end written takes a state slot);
- at a request's finish its finish checkpoint (in decode, its decode checkpoint) is kept until
  ``MIN_OBSERVATIONS`` were left, then while the prompts resumed at finish checkpoints or their
  ghosts, ``H_F``, are more than none and at least ``p_M * C``: ``p_M`` the prompts that
  reached the ghost of an evicted checkpoint (not of the finish role: decode checkpoints and
  the finish checkpoints they become) per such eviction, ``C`` such evictions the finish role
  caused, each times the role's share of the cached checkpoints then (SPEC 13.8b: a finish
  checkpoint is worth the prompts it serves and costs the evictions of other roles' checkpoints
  it causes; its own evicted cost no other prompt);
- in arena storage each decode checkpoint after a request's first takes the first one's
  eviction stamp (its decode start), and a kept finish checkpoint is dated at the finish
  (``calls/token.py`` through the pool's ``_date``; SPEC 13.8b: rewriting a decode checkpoint
  is no use of the cache);
- at a request's finish each of its chunk ends (a prompt checkpoint other than its body end
  and branch point) still cached is kept until ``MIN_OBSERVATIONS`` were kept, then while hits
  per chunk end kept are at least hits per body end written; otherwise released (SPEC 13.8b);
- a checkpoint counts for its role at its first resume only (SPEC 13.8b: a shared prefix's
  later resumes come whether or not more checkpoints of its role are written);
- every count the rules compare decays by ``1 - 1/slots`` per admitted prompt (``slots`` the
  state pages the pool holds);
- whole hybrid prefixes (``prefixes.py``): full-attention pages on no cached checkpoint's path
  lose their keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

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
# Where each decayed count sits in ``ReuseEvidence.recent`` (the native engine's order): body
# ends written and resumed at; finish checkpoints left (kept or ghosts) and resumed at (or at a
# ghost); chunk ends kept and resumed at; checkpoints evicted other than the finish role's and
# prompts that reached their ghosts; the evictions of other roles' checkpoints the finish role
# caused (each such eviction times the finish role's share of the cached checkpoints then).
(
    _BODY_N,
    _BODY_HITS,
    _FINISH_N,
    _FINISH_HITS,
    _CHUNK_N,
    _CHUNK_HITS,
    _EVICTED_N,
    _EVICTED_HITS,
    _CAUSED,
) = range(9)
#: The ``eviction_policy`` names.
EVICTION_POLICIES = ("lru", "reuse")


def _pays(total: int, count: float, hits: float, ref_count: float, ref_hits: float) -> bool:
    """The rule every role of SPEC 13.8b follows: a role is kept (written) until
    ``MIN_OBSERVATIONS`` of it were counted (``total``), then while prompts resume at it per
    checkpoint (``hits / count``, decayed counts) at least as often as at the role it is
    compared with (``ref_hits / ref_count``), cross-multiplied."""
    return total < MIN_OBSERVATIONS or hits * ref_count >= ref_hits * count


def _remember(ghosts: OrderedDict[str, None], page_hash: str, capacity: int) -> None:
    """Remember ``page_hash`` as the newest of ``ghosts``, at most ``capacity`` of them."""
    ghosts.pop(page_hash, None)
    ghosts[page_hash] = None
    while len(ghosts) > capacity:
        ghosts.popitem(last=False)


class ReuseEvidence:
    """Where prompts diverge, and where they resume, as the ``reuse`` policy saw it so far."""

    def __init__(self) -> None:
        self.seen = 0
        #: Of the divergence points seen, the multiples of ``G * 2**k``, ``k = 0..MAX_LEVEL``.
        self.multiples = [0] * (MAX_LEVEL + 1)
        #: The state pages whose checkpoint is a prompt's body end (SPEC 13.5b, ``BODY``), a chunk
        #: end (13.5a, ``CHUNK``) or a request's finish checkpoint (13.5d, ``FINISH``).
        self.roles: dict[int, str] = {}
        #: The state pages of ``roles`` whose checkpoint a prompt has resumed at since it was
        #: written: only a checkpoint's first resume counts for its role (SPEC 13.8b).
        self.served: set[int] = set()
        #: Body ends written and prompts that resumed at one; finish checkpoints the same.
        self.body_written = 0
        self.body_hits = 0
        self.finish_written = 0
        self.finish_hits = 0
        #: Chunk-end checkpoints kept at their request's finish, and prompts that resumed at one.
        self.chunk_kept = 0
        self.chunk_hits = 0
        #: Ghosts: finish checkpoints not kept, by the base-page hash of their boundary, oldest
        #: first (SPEC 13.8b).
        self.ghosts: OrderedDict[str, None] = OrderedDict()
        #: Cached checkpoints by key: the base-page hash of their boundary and whether it is of
        #: the finish role (a decode checkpoint), so that one the pool evicts leaves a ghost.
        self.boundary: dict[str, list[object]] = {}
        #: Ghosts of evicted checkpoints (not of the finish role), oldest first: a prompt that
        #: reaches one past its hit is a prompt a slot more of cache would have served.
        self.evicted_ghosts: OrderedDict[str, None] = OrderedDict()
        #: The counts the rules compare, decayed by :meth:`decay` at each admitted prompt
        #: (indexed by ``_BODY_N`` .. ``_CAUSED``); the counts above decide the warm-up.
        self.recent = [0.0] * 9
        #: Cached checkpoints in the finish role (decode checkpoints, kept finish checkpoints).
        self.finish_cached = 0

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
        self.served.discard(page)
        if role == BODY:
            self.body_written += 1
            self.recent[_BODY_N] += 1.0
        elif role == FINISH:
            self.finish_written += 1
            self.recent[_FINISH_N] += 1.0
        elif role == CHUNK:
            pass
        else:
            self.roles.pop(page, None)
            return
        self.roles[page] = role

    def resumed(self, page: int) -> None:
        """An admitted prompt resumed at the checkpoint on state page ``page``: counted for the
        checkpoint's role at its first resume only (SPEC 13.8b; a checkpoint resumed at again
        and again is a shared prefix, whose later resumes come whether or not more checkpoints
        of its role are written)."""
        role = self.roles.get(page)
        if role is None or page in self.served:
            return
        self.served.add(page)
        if role == BODY:
            self.body_hits += 1
            self.recent[_BODY_HITS] += 1.0
        elif role == FINISH:
            self.finish_hits += 1
            self.recent[_FINISH_HITS] += 1.0
        elif role == CHUNK:
            self.chunk_hits += 1
            self.recent[_CHUNK_HITS] += 1.0

    def left_ghost(self, page_hash: str, capacity: int) -> None:
        """A finished request's finish checkpoint was not kept (none written, or released): it
        is remembered as a ghost under ``page_hash``, the base-page hash of its boundary, and
        counted as a finish checkpoint left, so the finish rate keeps learning while none is
        kept (SPEC 13.8b). At most ``capacity`` ghosts, the oldest forgotten first; none with
        ``capacity == 0``."""
        if capacity == 0:
            return
        self.finish_written += 1
        self.recent[_FINISH_N] += 1.0
        _remember(self.ghosts, page_hash, capacity)

    def note_boundary(self, key: str, page_hash: str, finish: bool) -> None:
        """A checkpoint ``key`` whose boundary's base-page hash is ``page_hash`` was written,
        in the finish role (a decode checkpoint) or not."""
        old = self.boundary.get(key)
        if old is not None and old[1]:
            self.finish_cached = max(self.finish_cached - 1, 0)
        self.boundary[key] = [page_hash, finish]
        if finish:
            self.finish_cached += 1

    def forget_boundary(self, key: str) -> None:
        """The checkpoint ``key`` left the cache other than by eviction."""
        entry = self.boundary.pop(key, None)
        if entry is not None and entry[1]:
            self.finish_cached = max(self.finish_cached - 1, 0)

    def evicted(self, key: str, capacity: int) -> None:
        """The pool evicted checkpoint ``key``: one not of the finish role is counted, charged
        to the finish role by its share of the cached checkpoints, and remembered as an evicted
        ghost."""
        share = self.finish_cached / max(len(self.boundary), 1)
        entry = self.boundary.pop(key, None)
        if entry is None:
            return
        if entry[1]:
            # The finish role's own checkpoint: what it costs the role is in its hits.
            self.finish_cached = max(self.finish_cached - 1, 0)
            return
        self.recent[_CAUSED] += share
        self.recent[_EVICTED_N] += 1.0
        if capacity > 0:
            _remember(self.evicted_ghosts, str(entry[0]), capacity)

    def ghost_resumed(self, hashes: Sequence[str], hit: int, cap: int, grain: int, base: int) -> bool:
        """An admitted prompt with base-page hashes ``hashes`` resumed at ``hit`` tokens. Walking
        its boundaries ``b`` (multiples of ``grain``, ``hit < b <= cap``) deepest first, the
        first evicted ghost met counts as a prompt a slot more would have served, and a finish
        ghost met counts as a prompt resumed at a finish checkpoint and ends the walk; each
        ghost counted is forgotten. Returns whether a finish ghost was met."""
        if (not self.ghosts and not self.evicted_ghosts) or grain == 0 or base == 0:
            return False
        b = cap // grain * grain
        marginal = False
        while b > hit:
            index = b // base - 1
            if 0 <= index < len(hashes):
                h = hashes[index]
                if h in self.ghosts:
                    del self.ghosts[h]
                    self.finish_hits += 1
                    self.recent[_FINISH_HITS] += 1.0
                    return True
                if not marginal and h in self.evicted_ghosts:
                    del self.evicted_ghosts[h]
                    marginal = True
                    self.recent[_EVICTED_HITS] += 1.0
            b -= grain
        return False

    def decay(self, slots: int) -> None:
        """An admitted prompt ages the evidence: every count the rules compare is multiplied by
        ``1 - 1 / slots``, ``slots`` the state pages the pool holds (about one turnover of the
        checkpoints it can keep), so a role's rate follows what the cache sees now and turns
        back when the workload changes shape. Nothing with ``slots == 0``."""
        if slots == 0:
            return
        factor = 1.0 - 1.0 / slots
        self.recent = [x * factor for x in self.recent]

    def is_chunk_end(self, page: int) -> bool:
        """Whether the checkpoint on state page ``page`` was written as a chunk end (SPEC 13.8b)."""
        return self.roles.get(page) == CHUNK

    def keep_chunk_end(self) -> bool:
        """At a request's finish, whether one of its chunk-end checkpoints still cached is kept
        (counted as kept) or released (SPEC 13.8b): kept until ``MIN_OBSERVATIONS`` were kept,
        then while a chunk end kept is resumed from at least as often as a body end written."""
        r = self.recent
        keep = _pays(self.chunk_kept, r[_CHUNK_N], r[_CHUNK_HITS], r[_BODY_N], r[_BODY_HITS])
        if keep:
            self.chunk_kept += 1
            self.recent[_CHUNK_N] += 1.0
        return keep

    def keep_finish(self) -> bool:
        """At a request's finish, whether its finish checkpoint, still cached, is kept (then
        :meth:`wrote` counts it as left) or released (SPEC 13.8b); in decode, whether a decode
        checkpoint is written. Kept until ``MIN_OBSERVATIONS`` were left, then while the
        prompts resumed at finish checkpoints or their ghosts are more than none and at least
        ``p_M * C`` (module doc; decayed counts, cross-multiplied)."""
        if self.finish_written < MIN_OBSERVATIONS:
            return True
        hits = self.recent[_FINISH_HITS]
        return hits > 0.0 and self._covers_evictions(hits, self.recent[_CAUSED])

    def _covers_evictions(self, hits: float, charged: float) -> bool:
        """Whether ``hits`` prompts served are at least what ``charged`` evictions cost,
        ``p_M`` each (decayed counts, cross-multiplied): the cost test of the finish and
        body-end rules (SPEC 13.8b)."""
        r = self.recent
        return hits * r[_EVICTED_N] >= r[_EVICTED_HITS] * charged

    def writes_body_end(self) -> bool:
        """Whether prompts' body ends are checkpointed (SPEC 13.8b): until ``MIN_OBSERVATIONS``
        were written, then while a body end written is resumed from at least as often as a
        finish checkpoint (the request's other checkpoint past its prompt's last sharing-grain
        boundary, which holds the same state memory and serves the prompts that share more),
        and as often as an eviction costs: ``H_B >= p_M * min(N_B, E)``, each body end written
        charged one eviction (it takes a state slot, and under pressure a checkpoint leaves for
        it), never more than the evictions ``E`` there were (cross-multiplied)."""
        r = self.recent
        return _pays(self.body_written, r[_BODY_N], r[_BODY_HITS], r[_FINISH_N], r[_FINISH_HITS]) and (
            self.body_written < MIN_OBSERVATIONS
            or self._covers_evictions(r[_BODY_HITS], min(r[_BODY_N], r[_EVICTED_N]))
        )
