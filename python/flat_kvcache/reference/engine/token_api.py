"""Token-level requests (docs/requests-api.md; SPEC 8, 9, 12.4): the cache owns the tokens.

``add_request`` hashes the prompt and claims its capped prefix hit; ``append_tokens`` hashes
each base page once as it fills; ``schedule`` registers, reclaims and acquires at the
request's position; ``finish`` / ``preempt`` register what was computed and free the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from flat_kvcache.reference.engine._args import (
    RequestId,
    TokenIds,
    as_count,
    as_counts,
    as_extra_keys,
    as_flag,
    as_request_id,
    as_request_ids,
    as_token_ids,
    check_u64_total,
    shown_id,
)
from flat_kvcache.reference.engine.hash import hash_page, hash_pages
from flat_kvcache.reference.engine.page_api import PageTables
from flat_kvcache.reference.engine.rows import Rows
from flat_kvcache.reference.engine.table import Table, TokenState

__all__ = ["TokenApi"]


class TokenApi(PageTables, Rows):
    """Requests that own their tokens (``FlatKVCache``), on the shared page steps and the
    persistent rows a request may hold."""

    def _token_state(self, method: str, key: RequestId) -> tuple[list[Table], TokenState]:
        """A token-level request's tables and state: KeyError if unknown, ValueError if page-level."""
        tables = self._tables(key)
        state = self._token_states.get(key)
        if state is None:
            raise ValueError(f"{method}: request {shown_id(key)} is page-level (not created by add_request)")
        return tables, state

    def _capped_match(self, hashes: list[str], num_tokens: int) -> tuple[int, list[list[int]]]:
        """The prefix match over the first ``max((len - 1) // base, 0)`` base pages (SPEC 9):
        the last prompt token is always recomputed. Returns ``(hit tokens, pages)``.

        With a host tier the lookups answer device-or-host (a host hit is ``HOST_BIT | host
        page``), unless the free pages do not cover the claim plus one page per load: then the
        device-only match."""
        capped = hashes[: max(num_tokens - 1, 0) // self._base]
        if self._host is not None:
            bound, pages, _ = self._match(capped, tiered=True)
            device, loads = self._tiered_claim_cost(pages)
            if loads == 0 or device + loads <= self._pool.num_free:
                return bound, pages
        bound, pages, _ = self._match(capped, tiered=False)
        return bound, pages

    def _hash_prompt(
        self, prompt_token_ids: object, extra_keys: object
    ) -> tuple[list[int], list[str], list[str]]:
        """Tokens, chained base-page hashes and extra keys of a prompt (checked)."""
        tokens = as_token_ids(prompt_token_ids, "prompt_token_ids")
        keys = as_extra_keys(extra_keys)
        return tokens, hash_pages(tokens, self._base, extra_keys=keys), keys

    def add_request(
        self,
        req: RequestId,
        prompt_token_ids: TokenIds,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
        row: int | None = None,
    ) -> int:
        """A new token-level request for a non-empty prompt; returns its prefix hit in tokens.

        With caching on and ``use_prefix_cache`` the capped match is claimed and the request
        starts computed up to the hit. Nothing else is allocated. ``row``: the request owns that
        row of the tables bound by ``bind_rows`` (it must be free) until it is freed.
        """
        use_cache = as_flag(use_prefix_cache, "use_prefix_cache")
        key = as_request_id(req)
        wanted_row = None if row is None else as_count(row, "row")
        tokens, hashes, keys = self._hash_prompt(prompt_token_ids, extra_keys)
        row_index = self._check_new_request("add_request", key, tokens, wanted_row)
        return self._add_checked(key, tokens, hashes, keys, use_cache, row_index)

    def _check_new_request(
        self, method: str, key: RequestId, tokens: list[int], row: int | None
    ) -> int | None:
        """Refuse, for ``method``, a request that cannot be added (its row not free, its id in
        use, an empty prompt); returns the row's index, if any."""
        row_index = None if row is None else self._check_row_free(row)
        if key in self._requests:
            raise ValueError(f"{method}: request {shown_id(key)} already exists")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        return row_index

    def _add_checked(
        self,
        key: RequestId,
        tokens: list[int],
        hashes: list[str],
        keys: list[str],
        use_cache: bool,
        row_index: int | None,
    ) -> int:
        """``add_request`` once its arguments are checked; returns the hit."""
        hit = 0
        self._requests[key] = [Table() for _ in self._managers]
        state = TokenState(tokens, hashes, keys)
        self._token_states[key] = state
        if use_cache and self._enable_caching:
            hit, pages = self._capped_match(hashes, len(tokens))
            self._claim_tiered(key, pages, state)
            self._counters["prefix_queries_tokens"] += len(tokens)
            self._counters["prefix_hits_tokens"] += hit
            self._counters["host_hits_tokens"] += self._host_hit_tokens(pages, hit)
        state.computed = hit
        state.registered = hit // self._base
        if row_index is not None:
            self._assign_row(key, row_index)
        return hit

    def append_tokens(self, req: RequestId, token_ids: TokenIds) -> None:
        """Append newly known tokens; each base page that fills is hashed once, chained (SPEC 12.4)."""
        key = as_request_id(req)
        tokens = as_token_ids(token_ids, "token_ids")
        self._token_state("append_tokens", key)
        self._append_checked(key, tokens)

    def _append_checked(self, key: RequestId, tokens: list[int]) -> None:
        _, state = self._token_state("append_tokens", key)
        state.tokens.extend(tokens)
        while len(state.hashes) < len(state.tokens) // self._base:
            start = len(state.hashes) * self._base
            prior = state.hashes[-1] if state.hashes else ""
            state.hashes.append(hash_page(state.tokens[start : start + self._base], prior, state.extra_keys))

    def append_tokens_batch(
        self,
        reqs: Sequence[RequestId],
        token_ids: TokenIds,
        num_tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
    ) -> None:
        """``append_tokens`` for many requests in one call, after validating everything.

        Request ``i`` gets the next ``num_tokens[i]`` entries of the flat ``token_ids``, or
        exactly one each when ``num_tokens`` is None.
        """
        keys = as_request_ids(reqs)
        tokens = as_token_ids(token_ids, "token_ids")
        counts = self._append_counts(len(keys), "reqs", tokens, num_tokens)
        for key in keys:
            self._token_state("append_tokens_batch", key)
        self._append_keys(keys, tokens, counts)

    def append_tokens_rows(
        self,
        rows: Sequence[int] | npt.NDArray[np.integer[Any]],
        token_ids: TokenIds,
        num_tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None,
    ) -> None:
        """``append_tokens_batch`` addressed by persistent rows (the request holding ``rows[i]``)."""
        indices = as_counts(rows, "rows")
        tokens = as_token_ids(token_ids, "token_ids")
        counts = self._append_counts(len(indices), "rows", tokens, num_tokens)
        keys = [self._row_owner("append_tokens_rows", row) for row in indices]
        self._append_keys(keys, tokens, counts)

    @staticmethod
    def _append_counts(
        length: int,
        what: str,
        tokens: list[int],
        num_tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | None,
    ) -> list[int]:
        """Tokens per entry of a batch append of ``length`` entries (``what`` names the batch)."""
        if num_tokens is None:
            if len(tokens) != length:
                raise ValueError(
                    f"token_ids has {len(tokens)} entries but {what} has {length} "
                    "(one token per request without num_tokens)"
                )
            return [1] * length
        counts = as_counts(num_tokens, "num_tokens")
        if len(counts) != length:
            raise ValueError(f"num_tokens has {len(counts)} entries but {what} has {length}")
        total = check_u64_total(sum(counts), "num_tokens")
        if total != len(tokens):
            raise ValueError(f"num_tokens adds up to {total} but token_ids has {len(tokens)} entries")
        return counts

    def _append_keys(self, keys: list[RequestId], tokens: list[int], counts: list[int]) -> None:
        start = 0
        for key, count in zip(keys, counts, strict=True):
            self._append_checked(key, tokens[start : start + count])
            start += count

    def num_computed_tokens(self, req: RequestId) -> int:
        return self._token_state("num_computed_tokens", as_request_id(req))[1].computed

    def num_tokens(self, req: RequestId) -> int:
        return len(self._token_state("num_tokens", as_request_id(req))[1].tokens)

    def _check_known(
        self, method: str, key: RequestId, state: TokenState, n: int, row: int | None = None
    ) -> None:
        """``n`` more tokens from the request's position must be known (``row``: named too)."""
        if state.computed + n > len(state.tokens):
            shown = shown_id(key) if row is None else f"{shown_id(key)} (row {row})"
            raise ValueError(
                f"{method}: num_new_tokens = {n} for request {shown} asks for more tokens than are "
                f"known: {state.computed} computed of {len(state.tokens)}"
            )

    def schedule(self, req: RequestId, num_new_tokens: int, *, lookahead: int = 0) -> bool:
        """Schedule the next ``num_new_tokens`` known tokens at the request's position (SPEC 8).

        Register the completed full pages, reclaim slid-out pages, then acquire room for
        ``computed + n + lookahead`` tokens all or nothing. True: the position moved by ``n``
        and the reserve was released. False: nothing allocated, the position stays.
        """
        key = as_request_id(req)
        count = as_count(num_new_tokens, "num_new_tokens")
        ahead = as_count(lookahead, "lookahead")
        _, state = self._token_state("schedule", key)
        self._check_loaded("schedule", key)
        self._check_known("schedule", key, state, count)
        check_u64_total(state.computed + count + ahead, "lookahead")
        return self._schedule_checked(key, count, ahead)

    def schedule_batch(
        self, reqs: Sequence[RequestId], num_new_tokens: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> npt.NDArray[np.bool_]:
        """``schedule(req, n)`` for each pair in order, after validating every pair first."""
        keys = as_request_ids(reqs)
        counts = as_counts(num_new_tokens, "num_new_tokens")
        if len(counts) != len(keys):
            raise ValueError(f"num_new_tokens has {len(counts)} entries but reqs has {len(keys)}")
        asked: dict[RequestId, int] = {}
        for key, count in zip(keys, counts, strict=True):
            _, state = self._token_state("schedule_batch", key)
            self._check_loaded("schedule_batch", key)
            asked[key] = check_u64_total(asked.get(key, 0) + count, "num_new_tokens")
            self._check_known("schedule_batch", key, state, asked[key])
        results = [self._schedule_checked(key, count, 0) for key, count in zip(keys, counts, strict=True)]
        return np.array(results, dtype=np.bool_)

    def schedule_rows(
        self,
        rows: Sequence[int] | npt.NDArray[np.integer[Any]],
        num_new_tokens: Sequence[int] | npt.NDArray[np.integer[Any]],
    ) -> npt.NDArray[np.bool_]:
        """``schedule_batch`` addressed by persistent rows (the request holding ``rows[i]``)."""
        indices = as_counts(rows, "rows")
        counts = as_counts(num_new_tokens, "num_new_tokens")
        if len(counts) != len(indices):
            raise ValueError(f"num_new_tokens has {len(counts)} entries but rows has {len(indices)}")
        keys: list[RequestId] = []
        asked: dict[RequestId, int] = {}
        for row, count in zip(indices, counts, strict=True):
            key = self._row_owner("schedule_rows", row)
            keys.append(key)
            self._check_loaded("schedule_rows", key)
            state = self._token_states[key]
            asked[key] = check_u64_total(asked.get(key, 0) + count, "num_new_tokens")
            self._check_known("schedule_rows", key, state, asked[key], row)
        results = [self._schedule_checked(key, count, 0) for key, count in zip(keys, counts, strict=True)]
        return np.array(results, dtype=np.bool_)

    def _schedule_checked(self, key: RequestId, count: int, ahead: int) -> bool:
        tables, state = self._token_state("schedule", key)
        self._register_computed(tables, state)
        position = state.computed
        self._reclaim(tables, position)
        # Allocated tokens (claimed plus acquired) are the same in every group.
        allocated = len(tables[0].pages) * self._managers[0].page_size - tables[0].tail_avail
        needed = position + count + ahead - allocated
        if needed > 0 and not self._acquire(tables, needed):
            return False
        state.computed = position + count
        self._reserves.pop(key, None)
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
        self._register(tables, state.hashes[first:full], first, state.computed, state)
        state.registered = full

    def finish(self, req: RequestId) -> None:
        """Register the completed full pages, free everything in ``eviction_order``, forget the id."""
        self._finish("finish", as_request_id(req))

    def preempt(self, req: RequestId) -> list[int]:
        """``finish``, counted as a preemption; returns the request's whole token list to re-add."""
        tokens = self._finish("preempt", as_request_id(req))
        self._counters["preemptions"] += 1
        return tokens

    def _finish(self, method: str, key: RequestId) -> list[int]:
        tables, state = self._token_state(method, key)
        self._register_computed(tables, state)
        self._release(key)
        return state.tokens
