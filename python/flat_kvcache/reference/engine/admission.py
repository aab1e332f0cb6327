"""Admission accounting (SPEC 9): what admitting a prompt would cost, and pages promised ahead."""

from __future__ import annotations

from collections.abc import Sequence

from flat_kvcache.reference.engine._args import (
    RequestId,
    TokenIds,
    as_count,
    as_flag,
    as_request_id,
    check_u64_total,
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
        total = self.pages_needed(check_u64_total(count + extra, "num_new_tokens + reserve_tokens"))
        device, loads = self._tiered_claim_cost(pages)
        return check_u64_total(total + device + loads, "num_new_tokens + reserve_tokens")

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
        else ``add_request`` and ``(hit, chunk)``. The prompt is hashed and matched once."""
        use_cache = as_flag(use_prefix_cache, "use_prefix_cache")
        key = as_request_id(req)
        limit = as_count(max_new_tokens, "max_new_tokens")
        wanted_row = None if row is None else as_count(row, "row")
        tokens, hashes, keys = self._hash_prompt(prompt_token_ids, extra_keys)
        row_index = self._check_new_request("admit", key, tokens, wanted_row)
        hit, pages = self._capped_match(hashes, len(tokens)) if use_cache else (0, None)
        chunk = min(len(tokens) - hit, limit)
        reserve = 1 if hit + chunk == len(tokens) else 0
        # pages_needed_to_admit(prompt, chunk, reserve); without the prefix cache, no claim.
        device, loads = (0, 0) if pages is None else self._tiered_claim_cost(pages)
        if self.pages_needed(chunk + reserve) + device + loads > self.budget():
            return None
        self._add_checked(key, tokens, hashes, keys, use_cache, row_index)
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
