"""Routers of ``flat-kvcache simulate --workers N`` (docs/routing.md): round-robin and KV-aware.

:class:`KvRouter` keeps one :class:`~flat_kvcache.routing.adapter.WorkerAdapter` per worker, feeds
what they advertise into one Dynamo radix tree and predicts, per worker, the prefix hit (tokens)
that worker's ``admit`` would serve now. By default it routes a request to the best prediction,
ties to the least loaded worker, then the lowest worker id. With ``overlap_weight`` it routes by
Dynamo's own KV router cost instead: ``overlap_weight * prefill blocks + active blocks``, the
prefill blocks being the prompt's blocks the worker would compute (those past its predicted hit)
and the active blocks those of the requests the worker holds; the cheapest worker wins, ties to
the fewest requests, then the lowest id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from flat_kvcache.routing.adapter import MARK_TOKENS, WorkerAdapter, page_tokens_hashes
from flat_kvcache.routing.dynamo import DynamoIndex

__all__ = ["KvRouter", "RoundRobinRouter", "RouterKind", "check_kv_routable"]

RouterKind = Literal["round-robin", "kv"]


def check_kv_routable(specs: Sequence[Any], base_page_size: int) -> tuple[int, int | None]:
    """The full group's and the state group's indices for the kv router, or ``ValueError``
    naming the group it cannot predict exactly.

    Supported: one full-attention group whose page is the model's base page, and at most one
    state group. Sliding-window groups are refused (their hits also need the window's pages,
    which a consecutive-from-the-root index cannot express).
    """
    full: int | None = None
    state: int | None = None
    for index, spec in enumerate(specs):
        name = f"group {spec.group_id!r} ({spec.kind})"
        if spec.kind == "full" and full is None:
            full = index
        elif spec.kind == "state" and state is None:
            state = index
        else:
            raise ValueError(
                f"--router kv cannot predict hits exactly for {name}: it supports one full-attention "
                "group and at most one state group (use --router round-robin)"
            )
    if full is None:
        raise ValueError("--router kv needs a full-attention group (use --router round-robin)")
    if specs[full].page_size != base_page_size:
        raise ValueError(
            f"--router kv needs the full-attention page ({specs[full].page_size} tokens) to be the "
            f"base page ({base_page_size} tokens)"
        )
    return full, state


class RoundRobinRouter:
    """Worker 0, 1, ..., N - 1, 0, ... in arrival order."""

    kind: RouterKind = "round-robin"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._next = 0

    def route(
        self,
        prompt: Any,
        extra_keys: Sequence[str],
        loads: Sequence[int],
        active_blocks: Sequence[int] | None = None,
    ) -> tuple[int, int | None]:
        """The next worker in turn (nothing predicted); the other arguments are ignored."""
        worker = self._next
        self._next = (self._next + 1) % self.workers
        return worker, None


class KvRouter:
    """The KV-aware router over Dynamo's radix tree (module docstring)."""

    kind: RouterKind = "kv"

    def __init__(
        self, workers: int, specs: Sequence[Any], base_page_size: int, overlap_weight: float | None = None
    ) -> None:
        full, state = check_kv_routable(specs, base_page_size)
        if overlap_weight is not None and not (
            isinstance(overlap_weight, int | float)
            and not isinstance(overlap_weight, bool)
            and math.isfinite(overlap_weight)
            and overlap_weight >= 0
        ):
            raise ValueError(f"overlap_weight must be a finite number >= 0 or None, got {overlap_weight!r}")
        #: None: overlap first, load on ties; a number: Dynamo's cost (module docstring).
        self.overlap_weight = None if overlap_weight is None else float(overlap_weight)
        self.workers = workers
        self.page_size = int(specs[full].page_size)
        grain = None if state is None else int(specs[state].page_size)
        self.pages_per_grain = 1 if grain is None else grain // self.page_size
        self.adapters = [WorkerAdapter(self.page_size, full, state, grain) for _ in range(workers)]
        self.index = DynamoIndex()
        self.has_state = state is not None

    def feed(self, worker: int, events: Sequence[Any]) -> None:
        """Apply one worker's KV events (``take_events()``), in order."""
        if events:
            self.index.apply(worker, self.adapters[worker].apply(events))

    def predict(self, prompt: Any, extra_keys: Sequence[str] = ()) -> dict[int, int]:
        """Per worker, the prefix hit in tokens its ``admit`` would serve now (0 where absent).

        A hit never covers the prompt's last token: at most ``floor((len - 1) / P)`` pages.
        Without a state group that is the worker's consecutive depth; with one, the deepest
        grain boundary within that depth whose marked block the worker advertises.
        """
        size = self.page_size
        cap = max(len(prompt) - 1, 0) // size
        query = page_tokens_hashes(prompt[: cap * size], size, extra_keys)
        depths = self.index.match_depths(query)
        if not self.has_state:
            return {worker: depth * size for worker, depth in depths.items()}
        step = self.pages_per_grain
        open_ = {worker: depth for worker, depth in depths.items() if depth >= step}
        predicted = dict.fromkeys(depths, 0)
        boundary = max(open_.values(), default=0) // step * step
        while open_ and boundary >= step:
            asked = [worker for worker, depth in open_.items() if depth >= boundary]
            if asked:
                marked = self.index.match_depths([*query[: boundary - 1], query[boundary - 1] ^ MARK_TOKENS])
                for worker in asked:
                    if marked.get(worker, 0) == boundary:
                        predicted[worker] = boundary * size
                        del open_[worker]
            boundary -= step
        return predicted

    def route(
        self,
        prompt: Any,
        extra_keys: Sequence[str],
        loads: Sequence[int],
        active_blocks: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """The chosen worker and its predicted hit.

        ``loads`` are the workers' request counts. Without ``overlap_weight``: best prediction,
        then fewest ``loads``, then lowest id. With it: least ``overlap_weight * (ceil(len(prompt)
        / P) - hit / P) + active_blocks[w]`` (``active_blocks``, the blocks of the requests each
        worker holds, is then required), then fewest ``loads``, then lowest id.
        """
        predicted = self.predict(prompt, extra_keys)
        if self.overlap_weight is None:
            worker = min(range(self.workers), key=lambda w: (-predicted.get(w, 0), loads[w], w))
            return worker, predicted.get(worker, 0)
        if active_blocks is None or len(active_blocks) != self.workers:
            raise ValueError(
                f"active_blocks must give one block count per worker ({self.workers}) "
                "when overlap_weight is set"
            )
        weight = self.overlap_weight
        prompt_blocks = -(-len(prompt) // self.page_size)

        def cost(w: int) -> tuple[float, int, int]:
            prefill = prompt_blocks - predicted.get(w, 0) // self.page_size
            return (weight * prefill + active_blocks[w], loads[w], w)

        worker = min(range(self.workers), key=cost)
        return worker, predicted.get(worker, 0)
