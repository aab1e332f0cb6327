"""Admission accounting (SPEC 9): what admitting a prompt would cost, and pages promised ahead."""

from __future__ import annotations

from collections.abc import Sequence

from flat_kvcache.reference.engine._args import (
    RequestId,
    TokenIds,
    as_count,
    as_flag,
    as_request_id,
    check_u64,
)
from flat_kvcache.reference.engine.token_api import TokenApi

__all__ = ["Admission"]


class Admission(TokenApi):
    """Read-only admission probes and the per-request reserves."""

    def prefix_hit_tokens(self, prompt_token_ids: TokenIds, *, extra_keys: Sequence[str] = ()) -> int:
        """The (capped) hit ``add_request`` would get, read-only."""
        tokens, hashes, _ = self._hash_prompt(prompt_token_ids, extra_keys)
        return self._capped_match(hashes, len(tokens))[0]

    def pages_needed_to_admit(
        self,
        prompt_token_ids: TokenIds,
        num_new_tokens: int,
        reserve_tokens: int = 0,
        *,
        extra_keys: Sequence[str] = (),
    ) -> int:
        """Pages the capped match's claim takes (its free cached pages, plus one device page per
        host-tier load) plus ``pages_needed(new + reserve)`` on fresh tables."""
        count = as_count(num_new_tokens, "num_new_tokens")
        extra = as_count(reserve_tokens, "reserve_tokens")
        tokens, hashes, _ = self._hash_prompt(prompt_token_ids, extra_keys)
        _, pages = self._capped_match(hashes, len(tokens))
        total = self.pages_needed(check_u64(count + extra, "num_new_tokens + reserve_tokens"))
        device, loads = self._tiered_claim_cost(pages)
        return check_u64(total + device + loads, "num_new_tokens + reserve_tokens")

    def admit(
        self,
        req: RequestId,
        prompt_token_ids: TokenIds,
        max_new_tokens: int,
        *,
        extra_keys: Sequence[str] = (),
        use_prefix_cache: bool = True,
        row: int | None = None,
    ) -> tuple[int, int] | None:
        """SPEC 9 admission: the first chunk is ``min(len - hit, max_new_tokens)`` tokens after
        the capped hit, plus one token of reserve when it completes the prompt. None (nothing
        changes) when ``pages_needed_to_admit(prompt, chunk, reserve)`` exceeds ``budget()``;
        else ``add_request`` and ``(hit, chunk)``. The calls a scheduler would make, in turn."""
        use_cache = as_flag(use_prefix_cache, "use_prefix_cache")
        key = as_request_id(req)
        limit = as_count(max_new_tokens, "max_new_tokens")
        wanted_row = None if row is None else as_count(row, "row")
        tokens, _, keys = self._hash_prompt(prompt_token_ids, extra_keys)
        if wanted_row is not None:
            self._check_row_free(wanted_row)
        if key in self._requests:
            raise ValueError(f"admit: request {key!r} already exists")
        if not tokens:
            raise ValueError("prompt_token_ids must not be empty")
        hit = self.prefix_hit_tokens(tokens, extra_keys=keys) if use_cache else 0
        chunk = min(len(tokens) - hit, limit)
        reserve = 1 if hit + chunk == len(tokens) else 0
        if use_cache:
            need = self.pages_needed_to_admit(tokens, chunk, reserve, extra_keys=keys)
        else:
            need = self.pages_needed(chunk + reserve)
        if need > self.budget():
            return None
        self.add_request(key, tokens, extra_keys=keys, use_prefix_cache=use_cache, row=wanted_row)
        return hit, chunk

    def reserve(self, req: RequestId, tokens: int) -> None:
        """Promise ``pages_needed(tokens, req)`` pages to the request's next decode (replaces)."""
        key = as_request_id(req)
        count = as_count(tokens, "tokens")
        self._reserves[key] = self.pages_needed(count, key)

    def budget(self, req: RequestId | None = None) -> int:
        """Free pages minus the reserves of every request other than ``req`` (may be negative)."""
        own = 0
        if req is not None:
            key = as_request_id(req)
            self._tables(key)
            own = self._reserves.get(key, 0)
        return self._pool.num_free - (sum(self._reserves.values()) - own)
