"""Soak: a long random stream of slot-API calls, native vs reference, then a leak check.

Every call goes to both engines with the same arguments (requests named by the slots
``add_request`` returned, which both engines give alike); what each returns (or the class and
message of what it raises) must be equal, call after call. At the end every live request is
finished and the pool must be whole again in both engines: no page in use, every page but the
null page free, ``check_invariants()`` passes. ``--native-only`` drops the reference and samples
the process's resident set size (RSS) along the way, to show memory stays flat over millions of
calls.

    python benches/soak.py                          # 100,000 calls, native vs reference
    python benches/soak.py --ops 1000000 --native-only --rss-every 100000

The test suite runs the same driver at CI size (tests/requests/test_soak.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import flat_kvcache
import numpy as np
from flat_kvcache import reference

#: Groups of the soak model: full attention, a sliding window that is not a page multiple, and
#: a state group with a larger page, all in one pool small enough that calls run out of pages.
SPECS: tuple[tuple[str, int, int | None], ...] = (
    ("full", 4, None),
    ("sliding_window", 4, 7),
    ("state", 8, None),
)
#: Pages in the pool (the null page included).
NUM_PAGES = 96
#: Shared prompt prefixes, so that prefix hits, shared pages and evictions of cached pages occur.
NUM_PREFIXES = 6
#: Live requests at most (their slots are reused after finish and preempt).
MAX_LIVE = 10


@dataclass(frozen=True)
class Outcome:
    """What one call did: its value, or the class name and message of what it raised."""

    value: Any = None
    error: str | None = None
    message: str = ""

    def same(self, other: Outcome) -> bool:
        """Equal values, or the same exception class with the same message."""
        return self.value == other.value and self.error == other.error and self.message == other.message


def _plain(value: Any) -> Any:
    """A comparable form: arrays become lists, dicts of arrays dicts of lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
    try:
        return Outcome(value=_plain(fn(*args, **kwargs)))
    except Exception as exc:  # every exception is part of the compared behaviour
        return Outcome(error=type(exc).__name__, message=str(exc))


@dataclass
class SoakStats:
    """Counts of what the stream did, to show it exercised the engine."""

    calls: int = 0
    #: Calls other than the position reads made to choose arguments.
    ops: int = 0
    errors: int = 0
    #: Slots that ``schedule`` refused for lack of pages.
    refused_for_pages: int = 0
    #: The native engine's ``stats()`` before the drain.
    final_stats: dict[str, Any] = field(default_factory=dict)
    by_method: dict[str, int] = field(default_factory=dict)
    rss_kib: list[tuple[int, int]] = field(default_factory=list)


class Mismatch(AssertionError):
    """The engines disagreed on a call."""


class Soak:
    """Drives one or two engines with the same seeded stream of calls."""

    def __init__(self, seed: int, *, compare: bool = True) -> None:
        self.rng = random.Random(seed)
        self.engines: list[Any] = [self._make(flat_kvcache)]
        if compare:
            self.engines.append(self._make(reference))
        self.prefixes = [
            [self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(4, 40))]
            for _ in range(NUM_PREFIXES)
        ]
        #: Slots of the live requests.
        self.live: list[int] = []
        self.next_id = 0
        self.stats = SoakStats()

    @staticmethod
    def _make(module: Any) -> Any:
        specs = [
            module.KVCacheSpec(kind, page, window, f"{kind}_{i}")
            for i, (kind, page, window) in enumerate(SPECS)
        ]
        return module.FlatKVCache(specs, NUM_PAGES)

    # -- one call on every engine ---------------------------------------------------------------

    def apply(self, method: str, *args: Any, **kwargs: Any) -> Outcome:
        """Call ``method`` on every engine; the outcomes must agree. Returns the first's."""
        self.stats.calls += 1
        if method not in ("num_tokens", "num_computed_tokens"):
            self.stats.ops += 1
        self.stats.by_method[method] = self.stats.by_method.get(method, 0) + 1
        outcomes = [_call(getattr(engine, method), *args, **kwargs) for engine in self.engines]
        for other in outcomes[1:]:
            if not other.same(outcomes[0]):
                raise Mismatch(
                    f"call {self.stats.calls}: {method}{args!r} {kwargs!r}: "
                    f"native {outcomes[0]!r} != reference {other!r}"
                )
        first = outcomes[0]
        if first.error is not None:
            self.stats.errors += 1
        elif method == "schedule":
            self.stats.refused_for_pages += first.value.count(False)
        return first

    # -- the random stream -------------------------------------------------------------------

    def _prompt(self) -> list[int]:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(1, 50_000) for _ in range(rng.randrange(0 if prompt else 1, 30))]
        return prompt

    def _some_slot(self) -> int:
        """A live slot mostly; sometimes one that holds no request (the engines must both refuse it)."""
        if self.live and self.rng.random() < 0.95:
            return self.rng.choice(self.live)
        return self.rng.choice([s for s in range(MAX_LIVE + 2) if s not in self.live])

    def _pending(self, slot: int) -> int:
        """Tokens known but not computed yet for the request in ``slot`` (0 for a free slot)."""
        outcome = self.apply("num_tokens", slot)
        done = self.apply("num_computed_tokens", slot)
        if outcome.error or done.error:
            return 0
        return int(outcome.value) - int(done.value)

    def step(self) -> None:
        """One random call (some calls make a few reads to pick valid-looking arguments)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.12 and len(self.live) < MAX_LIVE:
            req = self.next_id
            self.next_id += 1
            prompt = self._prompt()
            if rng.random() < 0.3:
                self.apply("prefix_hit_tokens", prompt)
                self.apply("pages_needed_to_admit", prompt, rng.randrange(0, 40), rng.randrange(0, 8))
            added = self.apply("add_request", req, prompt)
            if added.error is None:
                self.live.append(added.value[0])  # (slot, hit)
        elif roll < 0.40:
            slot = self._some_slot()
            pending = self._pending(slot)
            n = rng.randrange(0, pending + 1) if rng.random() < 0.9 else pending + 1
            self.apply("schedule", [slot], [n], lookahead=rng.choice((0, 0, 0, 1, 3)))
        elif roll < 0.52:
            slots = rng.sample(self.live, rng.randrange(0, len(self.live) + 1)) if self.live else []
            self.apply("schedule", slots, [min(self._pending(s), rng.randrange(0, 6)) for s in slots])
        elif roll < 0.66:
            tokens = [rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 4))]
            self.apply("append_tokens", [self._some_slot()], tokens, [len(tokens)])
        elif roll < 0.74:
            slots = list(self.live)
            rng.shuffle(slots)
            self.apply("append_tokens", slots, [rng.randrange(0, 50_000) for _ in slots])
        elif roll < 0.80:
            self.apply("block_tables", rng.sample(self.live, min(len(self.live), 4)))
        elif roll < 0.85:
            self.apply("reserve", [self._some_slot()], [rng.randrange(0, 12)])
        elif roll < 0.89:
            self.apply("budget", self._some_slot() if rng.random() < 0.5 else None)
            self.apply("stats")
        elif roll < 0.95:
            slot = self._some_slot()
            if self.apply("finish", [slot]).error is None:
                self.live.remove(slot)
        elif roll < 0.985:
            slot = self._some_slot()
            outcome = self.apply("preempt", [slot])
            if outcome.error is None:
                self.live.remove(slot)
                folded = outcome.value[0]
                if folded and rng.random() < 0.8 and len(self.live) < MAX_LIVE:
                    # Recompute: the folded prompt comes back under a fresh id and hits its prefix.
                    new = self.next_id
                    self.next_id += 1
                    added = self.apply("add_request", new, folded)
                    if added.error is None:
                        self.live.append(added.value[0])
        else:
            self.apply("check_invariants")

    def drain(self) -> None:
        """Finish every live request; then nothing may be in use and every page is free."""
        self.stats.final_stats = dict(self.engines[0].stats())
        if self.live:
            self.apply("finish", list(self.live))
            self.live.clear()
        self.apply("check_invariants")
        for engine in self.engines:
            stats = engine.stats()
            if stats["pages_in_use"] != 0 or stats["requests"] != 0:
                raise AssertionError(f"pages leaked after finishing everything: {stats}")
            if engine.num_free_pages != NUM_PAGES - 1:
                raise AssertionError(f"{engine.num_free_pages} pages free of {NUM_PAGES - 1}")


def rss_kib() -> int:
    """The resident set size of this process in KiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(
    ops: int, seed: int, *, compare: bool = True, rss_every: int = 0, progress: bool = False
) -> SoakStats:
    """``ops`` random calls (not counting the reads made to choose arguments), then the drain check."""
    soak = Soak(seed, compare=compare)
    started = time.perf_counter()
    next_report = 0
    while soak.stats.ops < ops:
        soak.step()
        if rss_every and soak.stats.ops >= len(soak.stats.rss_kib) * rss_every:
            soak.stats.rss_kib.append((soak.stats.ops, rss_kib()))
        if progress and soak.stats.ops >= next_report:
            elapsed = time.perf_counter() - started
            print(f"  {soak.stats.ops:>9,} operations  {elapsed:7.1f} s", file=sys.stderr, flush=True)
            next_report += max(ops // 10, 1)
    soak.drain()
    if rss_every:
        soak.stats.rss_kib.append((soak.stats.ops, rss_kib()))
    return soak.stats


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--ops", type=int, default=100_000, help="operations to make (default 100,000; reads not counted)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--native-only", action="store_true", help="no reference: speed and RSS only")
    parser.add_argument("--rss-every", type=int, default=0, help="sample RSS every N calls (0: never)")
    args = parser.parse_args(argv)
    if args.ops <= 0:
        parser.error("--ops must be > 0")
    started = time.perf_counter()
    stats = run(args.ops, args.seed, compare=not args.native_only, rss_every=args.rss_every, progress=True)
    elapsed = time.perf_counter() - started
    mode = "native only" if args.native_only else "native == reference on every call"
    print(
        f"{stats.ops:,} operations ({stats.calls:,} calls with the reads) in {elapsed:.1f} s ({mode}); "
        f"{stats.errors:,} raised alike; {stats.refused_for_pages:,} slots refused by schedule for lack of "
        "pages; no page leaked"
    )
    final = stats.final_stats
    hits, queries = final.get("prefix_hits_tokens", 0), final.get("prefix_queries_tokens", 0)
    print(
        f"before the drain: {final.get('evictions', 0):,} evictions, "
        f"{final.get('preemptions', 0):,} preemptions, {hits:,} of {queries:,} prompt tokens hit"
    )
    print("calls by method: " + ", ".join(f"{k} {v:,}" for k, v in sorted(stats.by_method.items())))
    if stats.rss_kib:
        first, last = stats.rss_kib[0][1], stats.rss_kib[-1][1]
        peak = max(kib for _, kib in stats.rss_kib)
        mib = [kib / 1024 for kib in (first, last, peak)]
        print(f"RSS: {mib[0]:.1f} MiB at start, {mib[1]:.1f} MiB at the end, peak {mib[2]:.1f} MiB")
        for calls, kib in stats.rss_kib:
            print(f"  {calls:>10,} operations  {kib / 1024:8.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
