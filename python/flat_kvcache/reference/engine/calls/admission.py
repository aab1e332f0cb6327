"""Admission accounting (SPEC 9): what admitting a prompt would cost, and pages promised ahead."""

from __future__ import annotations

from collections.abc import Sequence

from flat_kvcache.reference.engine._args import (
    Counts,
    RequestId,
    SlotArray,
    TokenIds,
    as_count,
    as_counts,
    as_flag,
    as_request_id,
    as_slots,
    check_u64_total,
)
from flat_kvcache.reference.engine.calls.token import TokenApi
from flat_kvcache.reference.engine.host import HOST_BIT
from flat_kvcache.reference.engine.table import Table

__all__ = ["Admission"]


class Admission(TokenApi):
    """Read-only admission probes, ``admit``, and the per-request reserves (by slot)."""

    def prefix_hit_tokens(self, prompt_token_ids: TokenIds, *, extra_keys: Sequence[str] = ()) -> int:
        """The (capped) hit ``add_request`` would get, read-only."""
        tokens = self._prompt_tokens(prompt_token_ids)
        hashes, _ = self._hash_prompt(tokens, extra_keys)
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
        tokens = self._prompt_tokens(prompt_token_ids)
        count = as_count(num_new_tokens, "num_new_tokens")
        extra = as_count(reserve_tokens, "reserve_tokens")
        hashes, _ = self._hash_prompt(tokens, extra_keys)
        _, pages, _, _ = self._capped_match(hashes, len(tokens))
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
    ) -> tuple[int, int, int] | None:
        """SPEC 9 admission: the first chunk is ``min(len - hit, max_new_tokens)`` tokens after
        the capped hit, plus one token of reserve when it completes the prompt. None (nothing
        changes) when rows are bound and all their slots are held, or when
        ``pages_needed_to_admit(prompt, chunk, reserve)`` exceeds ``budget()``; else
        ``add_request`` and ``(slot, hit, chunk)``. The prompt is hashed and matched once."""
        key = as_request_id(req)
        tokens = self._prompt_tokens(prompt_token_ids, required=True)
        limit = as_count(max_new_tokens, "max_new_tokens")
        hashes, keys = self._hash_prompt(tokens, extra_keys)
        use_cache = as_flag(use_prefix_cache, "use_prefix_cache")
        self._check_new_request("admit", key)
        if not self._slot_available():
            return None
        hit, pages, branch, _ = self._capped_match(hashes, len(tokens)) if use_cache else (0, None, 0, 0)
        chunk = self._cut(hit, len(tokens), limit, branch)
        reserve = 1 if hit + chunk == len(tokens) else 0
        # pages_needed_to_admit(prompt, chunk, reserve); without the prefix cache, no claim.
        device, loads = (0, 0) if pages is None else self._tiered_claim_cost(pages)
        if self.pages_needed(chunk + reserve) + device + loads > self.budget():
            return None
        # In arena mode the credit only estimates: a group's pages come from its own units.
        if self._pool.is_arena and not self._fits_claim_then_acquire(pages, chunk + reserve):
            return None
        slot, hit = self._add_checked(key, tokens, hashes, keys, use_cache)
        return slot, hit, chunk

    def _fits_claim_then_acquire(self, pages: list[list[int]] | None, count: int) -> bool:
        """Whether a new request claiming ``pages`` (per group; None: no hit) and then taking
        ``count`` tokens finds its pages, as the pool would hand them out. A host hit (a tiered
        match's ``HOST_BIT`` entry) is a hole of the table and one more page of its group, taken
        with the group's acquire (an estimate: the claim takes it first)."""
        claimed: list[int] = []
        needs: list[int] = []
        for g, manager in enumerate(self._managers):
            group_pages = [] if pages is None else list(pages[g])
            loads = sum(1 for page in group_pages if page & HOST_BIT)
            group_pages = [0 if page & HOST_BIT else page for page in group_pages]
            claimed += [page for page in group_pages if page != 0]
            needs.append(manager.blocks_needed_for(Table(pages=group_pages), count) + loads)
        return self._pool.fits_after_claim(claimed, needs)

    def reserve(self, slots: SlotArray, tokens: Counts) -> None:
        """Promise ``pages_needed(tokens[i], slots[i])`` pages to the next decode of the request
        in ``slots[i]`` (replacing its reserve; 0 clears it; a repeated slot: the last counts).

        Checked first: the slots and the counts, their lengths, then each slot in order."""
        indices = as_slots(slots)
        counts = as_counts(tokens, "tokens")
        if len(counts) != len(indices):
            raise ValueError(f"tokens has {len(counts)} entries but slots has {len(indices)}")
        planned = []
        for slot, count in zip(indices, counts, strict=True):
            key = self._held("reserve", slot)
            planned.append((key, self._pages_needed(self._requests[key], count)))
        for key, pages in planned:
            self._reserves[key] = pages

    def budget(self, slot: int | None = None) -> int:
        """Free pages minus the reserves of every request other than the one in ``slot`` (may
        be negative)."""
        own = 0
        if slot is not None:
            own = self._reserves.get(self._slot_request("budget", slot), 0)
        return self._pool.num_free - (sum(self._reserves.values()) - own)
