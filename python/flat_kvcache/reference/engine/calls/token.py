"""Token-level requests (docs/requests-api.md; SPEC 8, 9, 12.4): the cache owns the tokens.

Each live request holds a *slot*, the lowest int no live request holds (given by
``add_request`` / ``admit``, freed by ``finish`` / ``preempt``); every later call names
requests by slot, and the per-step calls take a whole array of slots. ``add_request`` hashes
the prompt and claims its capped prefix hit; ``append_tokens`` hashes each base page once as it
fills; ``schedule`` registers, reclaims and acquires at each request's position (and, with
``register_on_schedule``, registers the pages the chunk fills, for same-step sharing); ``finish`` /
``preempt`` register what was computed and free the request and its slot. Every call checks
all its arguments before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.reference.engine._args import (
    Counts,
    RequestId,
    SlotArray,
    TokenIds,
    align_down,
    as_count,
    as_counts,
    as_extra_keys,
    as_flag,
    as_request_id,
    as_slot,
    as_slots,
    as_token_ids,
    check_u64_total,
    shown_id,
)
from flat_kvcache.reference.engine.calls.page import PageTables
from flat_kvcache.reference.engine.calls.rows import Rows
from flat_kvcache.reference.engine.events import removed_events
from flat_kvcache.reference.engine.hash import hash_page, hash_pages
from flat_kvcache.reference.engine.host import HOST_BIT
from flat_kvcache.reference.engine.policy import BODY, CHUNK, FINISH, OTHER
from flat_kvcache.reference.engine.table import Table, TokenState

__all__ = ["TokenApi"]


class TokenApi(PageTables, Rows):
    """Requests that own their tokens (``FlatKVCache``), named by slot, on the shared page
    steps; row ``s`` of the bound persistent rows is the request in slot ``s``."""

    # -- slots ----------------------------------------------------------------------------------

    def slot_of(self, req: RequestId) -> int | None:
        """The slot of the live request ``req``, or None."""
        return self._slot_of.get(as_request_id(req))

    def id_of(self, slot: int) -> RequestId:
        """The id the request in ``slot`` was added with (``UnknownRequestError`` if it holds none)."""
        return self._slot_request("id_of", slot)

    def _slot_request(self, method: str, slot: object) -> RequestId:
        """The id of the request in the slot argument of a one-slot call, checked for ``method``."""
        return self._held(method, as_slot(slot))

    def _token_state(self, key: RequestId) -> tuple[list[Table], TokenState]:
        """A live request's tables and token state (every request of this class has both)."""
        return self._requests[key], self._token_states[key]

    # -- adding a request -----------------------------------------------------------------------

    def _capped_match(self, hashes: list[str], num_tokens: int) -> tuple[int, list[list[int]], int, int]:
        """The prefix match over the first ``max((len - 1) // base, 0)`` base pages (SPEC 9):
        the last prompt token is always recomputed. Returns ``(hit tokens, pages, branch
        point, closed)``, the branch point as :meth:`_branch_point` makes it from ``closed``,
        the tokens the full-attention groups matched.

        With a host tier the lookups answer device-or-host (a host hit is ``HOST_BIT | host
        page``), unless the free pages do not cover the claim plus one page per load (in arena
        mode: the units they would bind): then the device-only match."""
        capped = hashes[: max(num_tokens - 1, 0) // self._base]
        if self._host is not None:
            bound, pages, _, closed = self._match(capped, tiered=True)
            loads = any(page & HOST_BIT for group in pages for page in group)
            if not loads or self._tiered_claim_fits(pages):
                return bound, pages, self._branch_point(bound, closed), closed
        bound, pages, _, closed = self._match(capped, tiered=False)
        return bound, pages, self._branch_point(bound, closed), closed

    def _branch_point(self, hit: int, closed: int) -> int:
        """SPEC 13.5c: the tokens the full-attention groups matched (``closed``), aligned down
        to the state grain, when beyond the hit (a checkpoint was missing there), else 0; 0
        without state groups. A chunk of the request ends there to write the checkpoint."""
        state_sizes = [self._specs[g].page_size for g in self._state_groups]
        if not state_sizes:
            return 0
        branch = align_down(closed, math.lcm(*state_sizes))
        return branch if branch > hit else 0

    @staticmethod
    def _prompt_tokens(prompt_token_ids: object, *, required: bool = False) -> list[int]:
        """A prompt's tokens, checked (not empty when ``required``: a request's prompt)."""
        tokens = as_token_ids(prompt_token_ids, "prompt_token_ids")
        if required and not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        return tokens

    def _hash_prompt(self, tokens: list[int], extra_keys: object) -> tuple[list[str], list[str]]:
        """Chained base-page hashes and the checked extra keys of a prompt's tokens."""
        keys = as_extra_keys(extra_keys)
        return hash_pages(tokens, self._base, extra_keys=keys), keys

    def add_request(
        self,
        req: RequestId,
        prompt_token_ids: TokenIds,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
    ) -> tuple[int, int]:
        """A new token-level request for a non-empty prompt; returns ``(slot, hit)``.

        With caching on and ``use_prefix_cache`` the capped match is claimed and the request
        starts computed up to the hit. Nothing else is allocated. The request gets the lowest
        free slot; with rows bound and all of their slots held it is refused (ValueError).
        """
        key = as_request_id(req)
        tokens = self._prompt_tokens(prompt_token_ids, required=True)
        hashes, keys = self._hash_prompt(tokens, extra_keys)
        use_cache = as_flag(use_prefix_cache, "use_prefix_cache")
        self._check_new_request("add_request", key)
        self._check_slot_free("add_request")
        return self._add_checked(key, tokens, hashes, keys, use_cache)

    def _check_new_request(self, method: str, key: RequestId) -> None:
        """Refuse, for ``method``, a request whose id is in use."""
        if key in self._requests:
            raise ValueError(f"{method}: request {shown_id(key)} already exists")

    def _add_checked(
        self, key: RequestId, tokens: list[int], hashes: list[str], keys: list[str], use_cache: bool
    ) -> tuple[int, int]:
        """``add_request`` once its arguments are checked (a slot is free); returns ``(slot, hit)``."""
        hit = 0
        self._requests[key] = [Table() for _ in self._managers]
        state = TokenState(tokens, hashes, keys, prompt_len=len(tokens))
        self._token_states[key] = state
        slot = self._take_slot(key)
        if use_cache and self._enable_caching:
            hit, pages, state.branch, closed = self._capped_match(hashes, len(tokens))
            cap = (len(tokens) - 1) // self._base * self._base
            if self._policy == "reuse" and self._state_grain is not None and 0 < closed < cap:
                # SPEC 13.8: the match left a cached path here (a divergence point).
                self._evidence.observe(closed, self._state_grain)
            self._claim_tiered(key, pages, state)
            if self._policy == "reuse" and len(self._state_groups) == 1 and self._state_grain is not None:
                # SPEC 13.8b: which checkpoint the prompt resumes at, and whether it would have
                # resumed deeper at a finish checkpoint that was not kept (a ghost).
                self._evidence.decay(self._state_slots())
                ghost = self._evidence.ghost_resumed(
                    hashes, hit, len(tokens) - 1, self._state_grain, self._base
                )
                # A prompt that a finish checkpoint not kept would have served deeper counts for
                # the finish role, not for the checkpoint it fell back to.
                if hit > 0 and not ghost:
                    group = self._state_groups[0]
                    at = (hit - 1) // self._specs[group].page_size
                    held = self._requests[key][group].pages
                    self._evidence.resumed(held[at] if at < len(held) else 0)
            self._counters["prefix_queries_tokens"] += len(tokens)
            self._counters["prefix_hits_tokens"] += hit
            self._counters["host_hits_tokens"] += self._host_hit_tokens(pages, hit)
            if hit > 0 and self._state_groups:
                self._counters["checkpoints_hit"] += 1
        state.computed = hit
        state.registered = hit // self._base
        return slot, hit

    # -- appending tokens -----------------------------------------------------------------------

    def append_tokens(self, slots: SlotArray, token_ids: TokenIds, num_tokens: Counts | None = None) -> None:
        """Append newly known tokens: slot ``i`` gets the next ``num_tokens[i]`` entries of the
        flat ``token_ids`` (exactly one each when ``num_tokens`` is None), in order; each base
        page that fills is hashed once, chained (SPEC 12.4).

        Checked first, in this order: the slots' types and values, the token values, the
        ``num_tokens`` values, the lengths, then that each slot holds a request.
        """
        indices = as_slots(slots)
        tokens = as_token_ids(token_ids, "token_ids")
        counts = self._append_counts(len(indices), tokens, num_tokens)
        keys = [self._held("append_tokens", slot) for slot in indices]
        start = 0
        for key, count in zip(keys, counts, strict=True):
            self._append_checked(key, tokens[start : start + count])
            start += count

    @staticmethod
    def _append_counts(length: int, tokens: list[int], num_tokens: Counts | None) -> list[int]:
        """Tokens per slot of an append to ``length`` slots."""
        if num_tokens is None:
            if len(tokens) != length:
                raise ValueError(
                    f"token_ids has {len(tokens)} entries but slots has {length} "
                    "(one token per request without num_tokens)"
                )
            return [1] * length
        counts = as_counts(num_tokens, "num_tokens")
        if len(counts) != length:
            raise ValueError(f"num_tokens has {len(counts)} entries but slots has {length}")
        total = check_u64_total(sum(counts), "num_tokens")
        if total != len(tokens):
            raise ValueError(f"num_tokens adds up to {total} but token_ids has {len(tokens)} entries")
        return counts

    def _append_checked(self, key: RequestId, tokens: list[int]) -> None:
        state = self._token_states[key]
        state.tokens.extend(tokens)
        while len(state.hashes) < len(state.tokens) // self._base:
            start = len(state.hashes) * self._base
            prior = state.hashes[-1] if state.hashes else ""
            state.hashes.append(hash_page(state.tokens[start : start + self._base], prior, state.extra_keys))

    # -- reading one slot -----------------------------------------------------------------------

    def next_chunk(self, slot: int, max_tokens: int) -> int:
        """How many of its next known tokens the request in ``slot`` should schedule, at most
        ``max_tokens`` (:meth:`_cut`); 0 once every known token is computed."""
        index = as_slot(slot)
        limit = as_count(max_tokens, "max_tokens")
        key = self._held("next_chunk", index)
        state = self._token_states[key]
        return self._cut(state.computed, len(state.tokens), limit, state.branch)

    def _cut(self, computed: int, known: int, limit: int, branch: int = 0) -> int:
        """The tokens to schedule from ``computed`` of ``known``, at most ``limit``: all that are
        left without state groups; with state groups, cut at their snapshot grain ``g`` (the lcm
        of their page sizes): first at the branch point ``branch`` while it lies ahead within
        ``limit`` and before the last known token; then, when the rest fits, at the last
        multiple of ``g`` before the last known token (the body; the tail follows next), else at
        the last multiple of ``g`` within ``limit``; no cut when no boundary lies ahead."""
        rest = max(known - computed, 0)
        state_sizes = [self._specs[g].page_size for g in self._state_groups]
        if not state_sizes:
            return min(rest, limit)
        if computed < branch < known and branch - computed <= limit:
            return branch - computed
        grain = math.lcm(*state_sizes)
        end = known - 1 if rest <= limit else computed + limit
        # The body's end lies on the sharing grain (SPEC 13.8; the state grain under lru); with
        # none ahead the rest is one chunk. A chunk cut by the limit: on the state grain.
        sharing = self._sharing_grain() or grain
        # Under reuse the body's end is written only while prompts resume there (SPEC 13.8b).
        if rest <= limit and self._policy == "reuse" and not self._evidence.writes_body_end():
            return rest
        if rest <= limit and sharing > grain:
            body = end - end % sharing
            return body - computed if body > computed else rest
        boundary = end - end % grain
        return boundary - computed if boundary > computed else min(rest, limit)

    def num_computed_tokens(self, slot: int) -> int:
        """Tokens computed so far by the request in ``slot``."""
        return self._token_states[self._slot_request("num_computed_tokens", slot)].computed

    def num_tokens(self, slot: int) -> int:
        """Tokens the request in ``slot`` knows (prompt plus appended)."""
        return len(self._token_states[self._slot_request("num_tokens", slot)].tokens)

    def page_ids(self, slot: int) -> list[list[int]]:
        """Each group's table of the request in ``slot`` (0 = hole)."""
        tables = self._requests[self._slot_request("page_ids", slot)]
        return [self._view_ids(g, table.pages) for g, table in enumerate(tables)]

    def tail_available(self, slot: int) -> list[int]:
        """Each group's free token slots in the last page of the request in ``slot``."""
        return [table.tail_avail for table in self._requests[self._slot_request("tail_available", slot)]]

    def loads_in_flight(self, slot: int) -> int:
        """Host-tier loads of the request in ``slot`` not acknowledged yet (0: it can be scheduled)."""
        return self._loading.get(self._slot_request("loads_in_flight", slot), 0)

    def pages_needed(self, num_tokens: int, slot: int | None = None) -> int:
        """Pages an acquire of ``num_tokens`` would allocate for the request in ``slot`` (fresh
        tables when ``slot`` is None)."""
        count = as_count(num_tokens, "num_tokens")
        tables = None if slot is None else self._requests[self._slot_request("pages_needed", slot)]
        return self._pages_needed(tables, count)

    def block_tables(self, slots: SlotArray, out: Any = None) -> Any:
        """Flat per-group block tables of the requests in ``slots`` (SPEC 8): ``{group_id:
        int32 [len(slots), cols]}`` (row ``r``: the pages of ``slots[r]``, holes 0, then -1), or
        written into ``out`` (see
        :meth:`~flat_kvcache.reference.engine.calls.tables.BlockTables._block_tables`)."""
        self._check_flat_build()
        indices = as_slots(slots)

        def resolve() -> list[list[Table]]:
            return [self._requests[self._held("block_tables", slot)] for slot in indices]

        def name(row: int) -> str:
            return f"request {self._named(self._id_at[indices[row]])}"

        return self._block_tables(resolve, name, out)

    # -- scheduling -----------------------------------------------------------------------------

    def _check_known(self, method: str, key: RequestId, state: TokenState, n: int) -> None:
        """``n`` more tokens from the request's position must be known."""
        if state.computed + n > len(state.tokens):
            raise ValueError(
                f"{method}: num_new_tokens = {n} for request {self._named(key)} asks for more tokens "
                f"than are known: {state.computed} computed of {len(state.tokens)}"
            )

    def schedule(
        self, slots: SlotArray, num_new_tokens: Counts, *, lookahead: int = 0
    ) -> npt.NDArray[np.bool_]:
        """Schedule the next ``num_new_tokens[i]`` known tokens of the request in ``slots[i]``,
        in order, each at its own position (SPEC 8); one bool per slot.

        Register the completed full pages, reclaim slid-out pages, then acquire room for
        ``computed + n + lookahead`` tokens all or nothing. True: the position moved by ``n``
        and the reserve was released (with ``register_on_schedule``, the full pages below the
        new position are registered then: same-step sharing). False: nothing allocated, the
        position stays.

        Everything is validated first: the lengths, then per slot in order that it holds a
        request with no host-tier loads in flight and that the tokens asked of it so far in
        this call (repeats count together) are known.
        """
        indices = as_slots(slots)
        counts = as_counts(num_new_tokens, "num_new_tokens")
        ahead = as_count(lookahead, "lookahead")
        if len(counts) != len(indices):
            raise ValueError(f"num_new_tokens has {len(counts)} entries but slots has {len(indices)}")
        if ahead > 0 and self._state_groups:
            raise ValueError(
                "schedule: lookahead must be 0 for a model with state groups (their state is kept "
                f"only after computed tokens, SPEC 13.4), got {ahead}"
            )
        keys: list[RequestId] = []
        asked: dict[RequestId, int] = {}
        for slot, count in zip(indices, counts, strict=True):
            key = self._held("schedule", slot)
            keys.append(key)
            self._check_loaded("schedule", key)
            state = self._token_states[key]
            asked[key] = check_u64_total(asked.get(key, 0) + count, "num_new_tokens")
            self._check_known("schedule", key, state, asked[key])
            check_u64_total(state.computed + asked[key] + ahead, "lookahead")
        results = [self._schedule_checked(key, count, ahead) for key, count in zip(keys, counts, strict=True)]
        return np.array(results, dtype=np.bool_)

    def state_slots(
        self, slots: SlotArray, num_new_tokens: Counts
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """The read and write state slots of a step (SPEC 13.4), after ``schedule(slots,
        num_new_tokens)``: the page of the state group holding the state after the request's
        last token before the step (0, the null slot, for a fresh request) and after its last
        new token, as ids of the state group's view; equal when the working page stayed or
        moved, different when the step starts from a checkpoint.

        Checked first: the lengths, exactly one state group, each slot holding a request, each
        count at most the request's computed tokens and equal to its last schedule's."""
        method = "state_slots"
        indices = as_slots(slots)
        counts = as_counts(num_new_tokens, "num_new_tokens")
        if len(counts) != len(indices):
            raise ValueError(f"num_new_tokens has {len(counts)} entries but slots has {len(indices)}")
        states = self._state_groups
        if len(states) != 1:
            raise ValueError(f"{method}: the model must have exactly one state group, it has {len(states)}")
        group = states[0]
        read: list[int] = []
        write: list[int] = []
        for slot, count in zip(indices, counts, strict=True):
            key = self._held(method, slot)
            _, state = self._token_state(key)
            start = state.computed - count
            if start < 0:
                raise ValueError(
                    f"{method}: num_new_tokens {count} exceeds the {state.computed} computed tokens of "
                    f"request {self._named(key)} (call it after schedule, with the same counts)"
                )
            if state.step is None or state.step[0] != count:
                last = "no schedule yet" if state.step is None else f"its last gave {state.step[0]}"
                raise ValueError(
                    f"{method}: num_new_tokens {count} is not what the last schedule of request "
                    f"{self._named(key)} gave it ({last})"
                )
            read_page, write_page = self._view_ids(group, list(state.step[1:]))
            read.append(read_page)
            write.append(write_page)
        return np.array(read, dtype=np.int32), np.array(write, dtype=np.int32)

    def _schedule_checked(self, key: RequestId, count: int, ahead: int) -> bool:
        """One request's step; with exactly one state group it records the step's state pages
        (read before the step, written after it) for :meth:`state_slots`."""
        tables, state = self._token_state(key)
        states = self._state_groups
        read = self._state_page(tables, state, states[0]) if len(states) == 1 else 0
        scheduled = self._schedule_tokens(tables, state, key, count, ahead)
        if len(states) == 1:
            write = self._state_page(tables, state, states[0])
            state.step = (count, read, write) if scheduled else None
        return scheduled

    def _state_page(self, tables: list[Table], state: TokenState, group: int) -> int:
        """The page of ``group`` holding the state after the request's computed tokens (0 before
        any token)."""
        if state.computed == 0:
            return 0
        pages = tables[group].pages
        slot = (state.computed - 1) // self._specs[group].page_size
        return pages[slot] if slot < len(pages) else 0

    def _schedule_tokens(
        self, tables: list[Table], state: TokenState, key: RequestId, count: int, ahead: int
    ) -> bool:
        """Register, reclaim, then acquire: the step itself."""
        self._register_computed(tables, state)
        position = state.computed
        self._reclaim(tables, position)
        self._date_decode_checkpoint(state)
        # Allocated tokens (claimed plus acquired) are the same in every group.
        allocated = len(tables[0].pages) * self._managers[0].page_size - tables[0].tail_avail
        needed = position + count + ahead - allocated
        if needed > 0 and not self._acquire(tables, needed):
            return False
        state.computed = position + count
        self._reserves.pop(key, None)
        if self._register_on_schedule:
            # Same-step sharing (docs/requests-api.md): the coming forward writes the chunk's
            # K/V in every layer before any attention reads it, so the pages it fills are
            # registered now and a request admitted later in this step may hit them. A page the
            # chunk fills only in part is not full and stays unregistered.
            self._register_computed(tables, state)
        return True

    def _register_computed(self, tables: list[Table], state: TokenState) -> None:
        """Register the full base pages below the position not registered yet (``end_tokens`` =
        the position). The range starts at the last base page aligned to every group's fold, so
        a group wider than a base page sees whole runs; re-registering caches nothing twice."""
        if not self._enable_caching:
            return
        full = min(state.computed // self._base, len(state.hashes))
        if full <= state.registered:
            return
        step = self._lcm // self._base
        first = state.registered - state.registered % step
        # State checkpoints where a step ended on the grain (SPEC 13.5a-c; in decode the latest
        # only, 13.5d). The prompt's end is one only once a token follows it: then it is the
        # state decode starts from, the first decode checkpoint.
        decoding = state.computed >= state.prompt_len and len(state.tokens) > state.prompt_len
        # SPEC 13.8b: under ``reuse`` a decode checkpoint is written only while finish
        # checkpoints are kept; one that would be released at the finish holds a state slot for
        # the whole decode and serves nothing.
        writes = not decoding or self._policy != "reuse" or self._evidence.keep_finish()
        end = state.computed if writes and (state.computed != state.prompt_len or decoding) else None
        self._register(tables, state.hashes[first:full], first, end, state)
        state.registered = full
        if decoding:
            self._keep_latest_decode_checkpoint(tables, state)
        elif self._policy == "reuse":
            self._note_prompt_checkpoint(tables, state)

    def _checkpoint_at(self, tables: list[Table], state: TokenState) -> tuple[int, str] | None:
        """The checkpoint at the request's position, if its state page took a key."""
        if len(self._state_groups) != 1:
            return None
        page = self._state_page(tables, state, self._state_groups[0])
        key = self._pool._key_held_by(page) if page else None
        return None if key is None else (page, key)

    def _note_prompt_checkpoint(self, tables: list[Table], state: TokenState) -> None:
        """SPEC 13.8 (reuse): remember a checkpoint written while computing the prompt (its path
        is kept at finish, whole hybrid prefixes)."""
        found = self._checkpoint_at(tables, state)
        if found is None:
            return
        if not state.prompt_checkpoints or state.prompt_checkpoints[-1][:2] != found:
            state.prompt_checkpoints.append((found[0], found[1], state.computed))
            # SPEC 13.8b: the body end is the last multiple of S before the prompt's last token.
            sharing = max(self._sharing_grain() or 1, 1)
            last = max(state.prompt_len - 1, 0)
            if state.computed == last - last % sharing:
                role = BODY
            elif state.computed == state.branch:
                role = OTHER
            else:
                role = CHUNK
            self._evidence.wrote(found[0], role)
            self._note_boundary(state, found[1], finish=False)

    def _note_boundary(self, state: TokenState, key: str, *, finish: bool) -> None:
        """SPEC 13.8b (reuse): remember the boundary of checkpoint ``key`` at the request's
        position, so that its eviction leaves a ghost, and whether it is in the finish role (a
        decode checkpoint: the finish checkpoint in the making)."""
        page_hash = self._boundary_hash(state, state.computed)
        if page_hash is not None:
            self._evidence.note_boundary(key, page_hash, finish)

    def _boundary_hash(self, state: TokenState, tokens: int) -> str | None:
        """The base-page hash that names a boundary at ``tokens`` (a multiple of the base page)
        of the request's path: that of its last base page; None at 0 or past the hashes known."""
        index = tokens // self._base - 1
        return state.hashes[index] if 0 <= index < len(state.hashes) else None

    def _drop_checkpoint(self, page: int, key: str) -> None:
        """Drop checkpoint ``key`` from ``page`` if it still holds it and nobody holds the page."""
        if self._pool._key_held_by(page) != key or self._pool._drop_free_key(page) is None:
            return
        self._evidence.forget_boundary(key)
        keys = [key]
        if self._whole_prefixes():
            self._drop_path(key, keys)
        if self._events_enabled:
            self._events.extend(removed_events(keys))

    def _end_of_request(self, state: TokenState) -> None:
        """SPEC 13.8 (reuse), when a request finished (its pages released): its finish
        checkpoint and chunk ends are kept (evicted like a page, 13.7) while their role pays
        (13.8b), every other checkpoint it wrote stays cached; with whole hybrid prefixes, its free
        full-attention pages on no cached checkpoint's path lose their keys."""
        found = state.decode_checkpoint
        if self._policy == "reuse":
            # SPEC 13.8b: the finish checkpoint is one a request leaves, while it pays; one not
            # kept (released, or never written by decode) leaves a ghost.
            held = found is not None and self._pool._key_held_by(found[0]) == found[1]
            keep = self._evidence.keep_finish()
            if held and keep:
                assert found is not None
                self._evidence.wrote(found[0], FINISH)
                # Its request's finish is its first use: the newest in the eviction order.
                self._pool._date(found[0], None)
            elif held:
                assert found is not None
                self._drop_checkpoint(*found)
                self._leave_ghost(state)
            elif not keep and found is None:
                self._leave_ghost(state)
        # SPEC 13.8b: its chunk-end checkpoints still cached are kept only while they pay.
        for page, key, _ in state.prompt_checkpoints:
            if (
                self._pool._key_held_by(page) == key
                and self._evidence.is_chunk_end(page)
                and not self._evidence.keep_chunk_end()
            ):
                self._drop_checkpoint(page, key)
        if self._whole_prefixes():
            self._keep_whole_prefixes(state)

    def _leave_ghost(self, state: TokenState) -> None:
        """SPEC 13.8b (reuse): a finished request whose finish checkpoint was not kept leaves a
        ghost at the boundary it would have had (the last multiple of the state grain within
        its computed tokens, if decode reached one at or past the prompt's end), at most as
        many as the pool has state pages."""
        grain = self._state_grain
        if len(self._state_groups) != 1 or grain is None:
            return
        at = state.computed // grain * grain
        if at == 0 or at < state.prompt_len or len(state.tokens) <= state.prompt_len:
            return
        page_hash = self._boundary_hash(state, at)
        if page_hash is not None:
            self._evidence.left_ghost(page_hash, self._state_slots())

    def _keep_whole_prefixes(self, state: TokenState) -> None:
        """SPEC 13.8 (reuse, whole hybrid prefixes; prefixes.py), at a request's finish:
        remember the path of each of its checkpoints still cached (a prompt checkpoint at ``t``
        holds ``[0, t)``; the decode checkpoint sits at the last multiple of the state grain),
        then drop its free full-attention pages no remembered path holds."""
        hashes = list(state.hashes)
        for page, key, tokens in state.prompt_checkpoints:
            if self._pool._key_held_by(page) == key:
                self._prefixes.remember(key, hashes, tokens // self._base)
        grain = self._state_grain
        if state.decode_checkpoint is not None and grain is not None:
            page, key = state.decode_checkpoint
            if self._pool._key_held_by(page) == key:
                self._prefixes.remember(key, hashes, state.computed // grain * grain // self._base)
        self._drop_unheld(state.hashes)

    def _keep_latest_decode_checkpoint(self, tables: list[Table], state: TokenState) -> None:
        """SPEC 13.5d: when the state page of the last computed token took a key in decode, it
        is the request's decode checkpoint; the previous one is dropped unless referenced."""
        found = self._checkpoint_at(tables, state)
        if found is None:
            return
        if self._policy == "reuse" and state.decode_checkpoint != found:
            self._evidence.wrote(found[0], OTHER)
            self._note_boundary(state, found[1], finish=True)
        previous, state.decode_checkpoint = state.decode_checkpoint, found
        if previous is not None and previous != found:
            state.decode_dated = False
            self._drop_checkpoint(*previous)

    def _date_decode_checkpoint(self, state: TokenState) -> None:
        """SPEC 13.8b (reuse, arena storage): a decode checkpoint serves no prompt while its
        request decodes (the next one replaces it a grain on; a continuation resumes at the
        finish), so writing it is no use of the cache: once free, each decode checkpoint after
        the first takes the first one's eviction stamp, the request's decode start, and ages from
        there; a kept finish checkpoint is dated at the finish (``_end_of_request``)."""
        found = state.decode_checkpoint
        if state.decode_dated or self._policy != "reuse" or found is None:
            return
        page, key = found
        if self._pool._key_held_by(page) != key:
            return
        stamp = self._pool._eviction_stamp(page)
        if stamp is None:
            return
        if state.decode_since is None:
            state.decode_since = stamp
        else:
            self._pool._date(page, state.decode_since)
        state.decode_dated = True

    # -- ending requests ------------------------------------------------------------------------

    def finish(self, slots: SlotArray) -> None:
        """For each slot in order: register the completed full pages, free everything in
        ``eviction_order``, release the reserve, and free the slot and the id."""
        self._end("finish", slots)

    def preempt(self, slots: SlotArray) -> list[list[int]]:
        """``finish``, counted as one preemption per slot; returns each request's whole token
        list (prompt plus generated), in order, to re-add for recompute."""
        ended = self._end("preempt", slots)
        self._counters["preemptions"] += len(ended)
        return ended

    def _end(self, method: str, slots: SlotArray) -> list[list[int]]:
        """End the requests in ``slots`` after checking each one, in order: it holds a request
        and is not listed earlier in the call. Returns their token lists."""
        indices = as_slots(slots)
        keys: list[RequestId] = []
        seen: set[int] = set()
        for slot in indices:
            key = self._held(method, slot)
            if slot in seen:
                raise ValueError(f"{method}: slot {slot} is listed twice")
            seen.add(slot)
            keys.append(key)
        ended = []
        for key in keys:
            tables, state = self._token_state(key)
            self._register_computed(tables, state)
            self._release(key)
            if method == "finish":
                self._end_of_request(state)
            ended.append(state.tokens)
        return ended
