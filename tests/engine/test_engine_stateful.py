"""Stateful cross-check: the native engine and the pure-Python reference, driven side by side.

Hypothesis state machines apply the same random operations to a *subject* and a *reference*
implementation and require identical results (return values, raised exception classes, page
ids, tail slots, pool probes) and ``check_invariants()`` on both after every step.

- ``engine_machine(subject, reference)`` drives ``PageCache`` over random hybrid spec mixes
  (page sizes that are multiples of one base, windows from 1 up, full / sliding / state groups,
  small pools so acquires fail, caching on and off, documents sharing prefixes so matches hit).
- ``pool_machine(subject, reference)`` drives ``BlockPool`` alone, misuse included.

The pair is a parameter: reference-vs-reference is a cheap sanity run of the machines
themselves; native-vs-reference is the real check (skipped until the native engine exists).
``HYPOTHESIS_PROFILE=ci`` runs 500 examples of each native-vs-reference machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
from helpers import normalize
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strategies import examples

REFERENCE: ModuleType = flat_kvcache.reference
NATIVE: ModuleType = flat_kvcache

#: Examples per machine: 500 under the CI profile (a few minutes on 2 cores), fewer locally.
NATIVE_EXAMPLES = examples(dev=100, ci=500)
#: Reference-vs-reference only checks the machine itself; keep it short.
SANITY_EXAMPLES = examples(dev=30, ci=30, variable="ENGINE_SANITY_EXAMPLES")


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------------------------------------------
# Comparing two implementations
# ------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one call did: its normalized result, or the class of the exception it raised."""

    raised: str | None
    value: Any = None
    raw: Any = None

    @property
    def ok(self) -> bool:
        return self.raised is None


def run(call: Callable[[], Any]) -> Outcome:
    try:
        result = call()
    except Exception as exc:
        return Outcome(type(exc).__name__)
    return Outcome(None, normalize(result), result)


def agree(what: str, subject: Outcome, reference: Outcome) -> Outcome:
    assert (subject.raised, subject.value) == (reference.raised, reference.value), (
        f"{what}: subject gave {subject.raised or subject.value!r}, reference gave "
        f"{reference.raised or reference.value!r}"
    )
    return reference


# ------------------------------------------------------------------------------------------------
# Engine machine
# ------------------------------------------------------------------------------------------------

KINDS = ("full", "sliding_window", "state", "chunked_local")


@st.composite
def engine_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A random hybrid model: 1 to 4 groups whose page sizes are multiples of one base.

    Windows are mostly short (so pages slide out within a few pages), sometimes up to three
    pages; a chunked group's chunk (the third item for it) is one to three pages. The pool is
    sized against one document's worth of pages: mostly room for a few
    requests, sometimes so small that most acquires fail.
    """
    base = draw(st.sampled_from([1, 2, 4]))
    groups = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(KINDS))
        page_size = base * draw(st.sampled_from([1, 1, 2, 2, 4, 3]))
        window = None
        if kind == "sliding_window":
            window = draw(st.one_of(st.integers(1, page_size + 1), st.integers(1, 3 * page_size + 2)))
        elif kind == "chunked_local":
            window = page_size * draw(st.integers(1, 3))  # the chunk: 1 to 3 pages
        groups.append((kind, page_size, window))
    sizes = [size for _, size, _ in groups]
    doc_length = 4 * math.lcm(*sizes) + math.gcd(*sizes)
    one_doc = sum(-(-doc_length // size) for size in sizes)
    return {
        "groups": groups,
        "doc_length": doc_length,
        "num_pages": draw(
            st.one_of(
                st.integers(1, one_doc // 2 + 1),
                st.integers(one_doc // 2, 3 * one_doc + 2),
                st.integers(one_doc, 3 * one_doc + 2),
            )
        ),
        "caching": draw(st.sampled_from([True, True, True, False])),
        "eviction_order": draw(st.sampled_from(["hybrid", "group"])),
        # State groups either move an unkeyed working page to the slot an acquire adds (the
        # default) or always take a fresh page there (vLLM's mamba "align" tables).
        "move_state_pages": draw(st.sampled_from([True, False])),
    }


@dataclass
class Request:
    """What the machine knows about a live request: its tokens and how many have slots."""

    rid: str | int
    tokens: list[int]
    allocated: int
    hashes: list[str] = field(default_factory=list)


class EngineMachine(RuleBasedStateMachine):
    """Drives a subject PageCache and a reference PageCache with identical operations."""

    subject_module: ModuleType = REFERENCE
    reference_module: ModuleType = REFERENCE

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.live: dict[str | int, Request] = {}
        # Matches taken earlier, possibly stale by now: (subject match, reference match, doc, length).
        self.saved: list[tuple[Any, Any, int, int]] = []

    # -- helpers ------------------------------------------------------------------------------

    def both(self, what: str, call: Callable[[Any, int], Any]) -> Outcome:
        """Run ``call(cache, side)`` on the subject (side 0) and the reference (side 1)."""
        return agree(what, run(lambda: call(self.subject, 0)), run(lambda: call(self.reference, 1)))

    def hashes_of(self, req: Request) -> list[str]:
        """Content hashes of every full base page of the request's known tokens (each hashed once)."""
        done = len(req.hashes)
        full = len(req.tokens) // self.base
        if full > done:
            prior = req.hashes[-1] if req.hashes else ""
            new = REFERENCE.hash_pages(
                req.tokens[done * self.base : full * self.base], self.base, prior=prior
            )
            req.hashes.extend(new)
        return req.hashes

    @staticmethod
    def spelled(hashes: list[str], data: st.DataObject) -> list[str | bytes]:
        """``hashes`` as a caller may pass them: 64-digit hex, their 32 raw bytes (vLLM's block
        hashes), or each either way; every call must treat the spellings as one hash."""
        form = data.draw(st.sampled_from(["hex", "hex", "bytes", "mixed"]))
        if form == "hex":
            return list(hashes)
        if form == "bytes":
            return [bytes.fromhex(h) for h in hashes]
        return [bytes.fromhex(h) if data.draw(st.booleans()) else h for h in hashes]

    def acquire_either(self, rid: str | int, num: int, data: st.DataObject) -> bool:
        """``acquire`` or ``acquire_pages`` on both sides (the same outcome); for the latter, the
        reference's answer must be the new slots of its ``page_ids``. Whether it allocated."""
        if data.draw(st.booleans()):
            outcome = self.both(f"acquire({rid!r}, {num})", lambda c, side: c.acquire(rid, num))
            return outcome.ok and outcome.value is True
        before = self.reference.page_ids(rid) if self.reference.has_request(rid) else None
        outcome = self.both(f"acquire_pages({rid!r}, {num})", lambda c, side: c.acquire_pages(rid, num))
        if not outcome.ok:
            return False
        after = self.reference.page_ids(rid)
        if before is None:
            before = [[] for _ in after]
        new = outcome.raw
        event(f"acquire_pages: {'refused' if new is None else 'grew' if any(new) else 'no new slot'}")
        if new is None:
            assert after == before, f"acquire_pages({rid!r}, {num}) refused but changed {before} to {after}"
            return False
        assert new == [ids[len(old) :] for ids, old in zip(after, before, strict=True)], (before, after, new)
        return True

    def grow(self, req: Request, upto: int, data: st.DataObject) -> None:
        """Make sure the request knows at least ``upto`` tokens (generated tokens are random)."""
        missing = upto - len(req.tokens)
        if missing > 0:
            req.tokens.extend(data.draw(st.lists(st.integers(0, 3), min_size=missing, max_size=missing)))

    def pick(self, data: st.DataObject) -> Request | None:
        """A live request; with none live, start one first (None if that did not create one)."""
        if not self.live:
            self.start(data)
        if not self.live:
            return None
        return self.live[data.draw(st.sampled_from(sorted(self.live, key=repr)))]

    def token_counts(self) -> st.SearchStrategy[int]:
        """Tokens for one step: a decode token, any small count, or whole lcm pages (so that
        requests land on page boundaries, where state groups take snapshots)."""
        lcm = self.reference.lcm_page_size
        return st.one_of(
            st.just(1),
            st.integers(0, 2 * self.max_page),
            st.integers(1, 2).map(lambda pages: pages * lcm),
        )

    def sync(self, rid: str | int) -> None:
        """After an operation that may create or drop a request, follow the reference."""
        if not self.reference.has_request(rid):
            self.live.pop(rid, None)

    # -- setup ----------------------------------------------------------------------------------

    @initialize(config=engine_configs(), data=st.data())
    def setup(self, config: dict[str, Any], data: st.DataObject) -> None:
        def build(module: ModuleType) -> Any:
            specs = [
                module.KVCacheSpec(kind, size, None, None, window)
                if kind == "chunked_local"
                else module.KVCacheSpec(kind, size, window)
                for kind, size, window in config["groups"]
            ]
            return module.PageCache(
                specs,
                config["num_pages"],
                enable_caching=config["caching"],
                eviction_order=config["eviction_order"],
                move_state_pages=config["move_state_pages"],
            )

        self.subject = build(self.subject_module)
        self.reference = build(self.reference_module)
        for name in ("base_page_size", "lcm_page_size", "num_groups", "num_free_pages"):
            assert getattr(self.subject, name) == getattr(self.reference, name), name
        assert list(self.subject.group_ids) == list(self.reference.group_ids)
        self.base = self.reference.base_page_size
        self.page_sizes = [size for _, size, _ in config["groups"]]
        self.max_page = max(self.page_sizes)
        # Documents: doc 1 shares a prefix with doc 0, so requests of both hit each other's pages.
        length = config["doc_length"]
        tokens = st.lists(st.integers(0, 3), min_size=length, max_size=length)
        doc0 = data.draw(tokens)
        shared = data.draw(st.integers(0, length))
        doc1 = doc0[:shared] + data.draw(tokens)[shared:]
        self.docs = [doc0, doc1, data.draw(tokens)]
        self.doc_hashes = [REFERENCE.hash_pages(doc, self.base) for doc in self.docs]
        subject_hashes = [self.subject_module.hash_pages(doc, self.base) for doc in self.docs]
        assert subject_hashes == self.doc_hashes
        self.next_id = 0
        self.ready = True
        # Usually warm the cache: one request runs a chunk and finishes, leaving its pages cached
        # (and free) for later requests to hit.
        if data.draw(st.sampled_from([True, True, True, False])):
            self.warm_up(data)

    def warm_up(self, data: st.DataObject) -> None:
        """A request on doc 0 prefills whole lcm pages in one chunk and finishes."""
        lcm = self.reference.lcm_page_size
        rid = self.new_id(data)
        req = Request(rid, list(self.docs[0]), 0)
        tokens = data.draw(st.integers(1, (len(req.tokens) - 1) // lcm)) * lcm
        empty = (self.subject.match_prefix([]), self.reference.match_prefix([]))
        outcome = self.both(
            f"prefill_first_chunk({rid!r}, {tokens}) (warm-up)",
            lambda c, side: c.prefill_first_chunk(rid, empty[side], tokens),
        )
        req.allocated = tokens if outcome.value is True else 0
        self.live[rid] = req
        self.finish_request(req)

    def new_id(self, data: st.DataObject) -> str | int:
        """A fresh request id: an int (sometimes huge) or a str (sometimes the digits of a live int)."""
        self.next_id += 1
        kind = data.draw(st.sampled_from(["int", "str", "big", "digits"]))
        if kind == "int":
            return self.next_id
        if kind == "big":
            return 2**70 + self.next_id
        if kind == "digits":
            return str(self.next_id - 1)  # "7" next to a live int 7: a different request
        return f"req-{self.next_id}"

    # -- rules ----------------------------------------------------------------------------------

    @rule(data=st.data())
    def remember_match(self, data: st.DataObject) -> None:
        """match_prefix on a document prefix; keep the match to claim later (it may go stale)."""
        doc = data.draw(st.integers(0, len(self.docs) - 1))
        count = data.draw(st.integers(0, len(self.doc_hashes[doc])))
        hashes = self.spelled(self.doc_hashes[doc][:count], data)
        subject = run(lambda: self.subject.match_prefix(hashes))
        reference = run(lambda: self.reference.match_prefix(hashes))
        agree(f"match_prefix({count} hashes of doc {doc})", subject, reference)
        if reference.ok:
            matches = (subject.raw, reference.raw)
            self.both("pages_consumed_by_claim", lambda c, side: c.pages_consumed_by_claim(matches[side]))
            self.saved.append((subject.raw, reference.raw, doc, count * self.base))
            del self.saved[:-4]

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """A new request: match its prompt (capped to leave the last token), claim, first chunk."""
        rid = self.new_id(data)
        if rid in self.live:
            return
        # Mostly doc 0 and its relative doc 1, so requests share prefixes; prompt lengths of
        # whole lcm pages plus one token make the capped match reach a common boundary.
        doc = data.draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
        lcm = self.reference.lcm_page_size
        whole = (len(self.docs[doc]) - 1) // lcm
        length = data.draw(
            st.one_of(st.integers(1, len(self.docs[doc])), st.integers(0, whole).map(lambda k: k * lcm + 1))
        )
        req = Request(rid, list(self.docs[doc][:length]), 0)
        hashes = self.hashes_of(req)
        cap = max((length - 1) // self.base, 0)  # SPEC 9: never match the last prompt token
        use = data.draw(st.sampled_from(["match", "match", "empty", "saved", "holes"]))
        if use == "saved" and self.saved:
            subject_match, reference_match, doc, end = data.draw(st.sampled_from(self.saved))
            req = Request(rid, list(self.docs[doc][: max(end, length)]), 0)
        else:
            wanted = self.spelled(hashes[:cap], data) if use != "empty" else []
            subject_match = self.subject.match_prefix(wanted)
            reference_match = self.reference.match_prefix(wanted)
            agree("match_prefix", run(lambda: subject_match), run(lambda: reference_match))
        if use == "holes":
            # A match built by hand with holes punched anywhere (as a host-tier extension might
            # leave them, SPEC 12.2): it remembers no keys, so claim only checks that each page
            # still holds a key of its group.
            pages = [
                [page if data.draw(st.booleans()) else 0 for page in group] for group in reference_match.pages
            ]
            hits = [sum(1 for page in group if page) for group in pages]
            common = reference_match.num_common_tokens
            subject_match = self.subject_module.PrefixMatch(common, pages, hits)
            reference_match = self.reference_module.PrefixMatch(common, pages, hits)
        matches = (subject_match, reference_match)
        common = int(reference_match.num_common_tokens)
        self.both("pages_consumed_by_claim", lambda c, side: c.pages_consumed_by_claim(matches[side]))
        remaining = max(0, len(req.tokens) - common)
        chunk = data.draw(st.one_of(self.token_counts(), st.integers(0, remaining + self.max_page)))
        how = data.draw(st.sampled_from(["prefill_first_chunk", "claim+acquire"]))
        if how == "prefill_first_chunk":
            outcome = self.both(
                f"prefill_first_chunk({rid!r}, chunk={chunk})",
                lambda c, side: c.prefill_first_chunk(rid, matches[side], chunk),
            )
        else:
            outcome = self.both(f"claim({rid!r})", lambda c, side: c.claim(rid, matches[side]))
            if outcome.ok:
                allocated = self.acquire_either(rid, chunk, data)
                outcome = Outcome(None, allocated, allocated)
        event(f"start: {'hit' if common else 'no hit'}, {outcome.raised or outcome.value}")
        if self.reference.has_request(rid):
            req.allocated = common + (chunk if outcome.ok and outcome.value is True else 0)
            self.live[rid] = req
        self.grow(req, req.allocated, data)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A later prefill chunk or a decode step: register, reclaim, acquire."""
        req = self.pick(data)
        if req is None:
            return
        computed = data.draw(st.sampled_from([req.allocated, data.draw(st.integers(0, req.allocated))]))
        num = data.draw(self.token_counts())
        self.grow(req, computed + num, data)
        hashes = self.spelled(self.hashes_of(req), data)
        rid = req.rid
        if data.draw(st.booleans()):
            outcome = self.both(
                f"prefill_chunk({rid!r}, n={num}, computed={computed})",
                lambda c, side: c.prefill_chunk(rid, hashes, num, computed),
            )
        else:
            first = data.draw(st.integers(0, computed // self.base))
            outcome = self.both(
                f"decode_step({rid!r}, first={first}, n={num}, computed={computed})",
                lambda c, side: c.decode_step(rid, hashes[first:], first, num, computed),
            )
        event(f"step: {outcome.raised or outcome.value}")
        if outcome.ok and outcome.value is True:
            req.allocated += num

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """The request completes: a last step registers every computed page, then free."""
        req = self.pick(data)
        if req is not None:
            self.finish_request(req)

    def finish_request(self, req: Request) -> None:
        computed = req.allocated
        hashes = list(self.hashes_of(req))
        self.both(
            f"decode_step({req.rid!r}, 0, n=0, computed={computed})",
            lambda c, side: c.decode_step(req.rid, hashes, 0, 0, computed),
        )
        self.both(f"free({req.rid!r})", lambda c, side: c.free(req.rid))
        self.sync(req.rid)

    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        req = self.pick(data)
        if req is None:
            return
        num = data.draw(self.token_counts())
        if self.acquire_either(req.rid, num, data):
            req.allocated += num
        self.grow(req, req.allocated, data)

    @rule(data=st.data())
    def register(self, data: st.DataObject) -> None:
        """Register a range of base pages inside the request's slots, with or without end_tokens.

        The range may run past the allocated tokens into a group's partly filled last page (the
        caller may know tokens it has not allocated yet): that page must not be registered.
        """
        req = self.pick(data)
        if req is None:
            return
        # Base pages every group's table covers: up to the end of each group's last slot.
        covered = min(-(-req.allocated // size) * size for size in self.page_sizes)
        pages = data.draw(st.sampled_from([req.allocated // self.base, covered // self.base]))
        self.grow(req, pages * self.base, data)
        first = data.draw(st.integers(0, pages))
        count = data.draw(st.integers(0, pages - first))
        hashes = self.spelled(self.hashes_of(req)[first : first + count], data)
        end = data.draw(
            st.sampled_from([None, (first + count) * self.base, data.draw(st.integers(0, req.allocated))])
        )
        self.both(
            f"register({req.rid!r}, first_slot={first}, {count} hashes, end_tokens={end})",
            lambda c, side: c.register(req.rid, hashes, first_slot=first, end_tokens=end),
        )

    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        req = self.pick(data)
        if req is None:
            return
        num = data.draw(st.sampled_from([req.allocated, data.draw(st.integers(0, req.allocated))]))
        uncached = data.draw(st.booleans())
        self.both(
            f"pages_reclaimable({req.rid!r}, {num}, count_uncached={uncached})",
            lambda c, side: c.pages_reclaimable(req.rid, num, count_uncached=uncached),
        )
        before = self.reference.num_free_pages
        expected = self.reference.pages_reclaimable(req.rid, num)
        self.both(f"reclaim({req.rid!r}, {num})", lambda c, side: c.reclaim(req.rid, num))
        assert self.reference.num_free_pages == before + expected  # the dry run is exact
        event(f"reclaim: {'freed pages' if expected else 'nothing'}")

    @rule(data=st.data())
    def claim_again(self, data: st.DataObject) -> None:
        """claim on an existing request: an error unless its tables are still empty."""
        if not self.saved:
            return
        req = self.pick(data)
        if req is None:
            return
        subject_match, reference_match, _, _ = data.draw(st.sampled_from(self.saved))
        matches = (subject_match, reference_match)
        outcome = self.both(f"claim({req.rid!r}) again", lambda c, side: c.claim(req.rid, matches[side]))
        event(f"claim again: {outcome.raised or 'ok'}")
        if outcome.ok:
            req.allocated = int(reference_match.num_common_tokens)
            self.grow(req, req.allocated, data)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req = self.pick(data)
        if req is None:
            return
        self.both(f"free({req.rid!r})", lambda c, side: c.free(req.rid))
        self.sync(req.rid)
        assert req.rid not in self.live

    @rule(data=st.data())
    def observe(self, data: st.DataObject) -> None:
        """Read-only calls: block tables of a batch, admission dry runs, unknown request ids."""
        ids = sorted(self.live, key=repr)
        batch = data.draw(st.lists(st.sampled_from(ids), max_size=5)) if ids else []
        self.both(f"block_tables({batch!r})", lambda c, side: c.block_tables(batch))
        num = data.draw(st.integers(0, 4 * self.max_page))
        ids = sorted(self.live, key=repr)
        with_request = data.draw(st.booleans())
        rid = data.draw(st.sampled_from(ids)) if ids and with_request else None
        self.both(f"pages_needed({num}, {rid!r})", lambda c, side: c.pages_needed(num, rid))
        # Every method but claim / acquire / prefill_first_chunk: KeyError for an unknown id.
        unknown = data.draw(st.sampled_from([10**6, "nobody", str(10**6)]))
        self.both("page_ids(unknown)", lambda c, side: c.page_ids(unknown))
        self.both("free(unknown)", lambda c, side: c.free(unknown))
        self.both("reclaim(unknown)", lambda c, side: c.reclaim(unknown, 1))
        self.both("register(unknown)", lambda c, side: c.register(unknown, []))

    # -- after every step -----------------------------------------------------------------------

    @invariant()
    def same_state(self) -> None:
        if not self.ready:
            return
        self.subject.check_invariants()
        self.reference.check_invariants()
        assert dict(self.subject.pool_stats()) == dict(self.reference.pool_stats())
        assert self.subject.num_free_pages == self.reference.num_free_pages
        assert self.subject.num_requests == self.reference.num_requests == len(self.live)
        for rid in self.live:
            assert self.subject.has_request(rid), rid
            assert [list(p) for p in self.subject.page_ids(rid)] == self.reference.page_ids(rid), rid
            assert list(self.subject.tail_available(rid)) == self.reference.tail_available(rid), rid


def engine_machine(subject: ModuleType, reference: ModuleType) -> type[EngineMachine]:
    """An EngineMachine comparing ``subject`` against ``reference``."""
    return type(
        f"EngineMachine_{subject.__name__.replace('.', '_')}",
        (EngineMachine,),
        {"subject_module": subject, "reference_module": reference},
    )


# ------------------------------------------------------------------------------------------------
# BlockPool machine
# ------------------------------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(5)]


class PoolMachine(RuleBasedStateMachine):
    """Drives a subject BlockPool and a reference BlockPool with identical operations, misuse too."""

    subject_module: ModuleType = REFERENCE
    reference_module: ModuleType = REFERENCE

    def __init__(self) -> None:
        super().__init__()
        self.ready = False

    def both(self, what: str, call: Callable[[Any], Any]) -> Outcome:
        return agree(what, run(lambda: call(self.subject)), run(lambda: call(self.reference)))

    def pages(self) -> st.SearchStrategy[int]:
        """Mostly valid page ids, sometimes one just out of range."""
        return st.integers(-1, self.num_blocks)

    @initialize(num_blocks=st.integers(1, 10), caching=st.sampled_from([True, True, False]))
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.num_blocks = num_blocks
        self.subject = self.subject_module.BlockPool(num_blocks, enable_caching=caching)
        self.reference = self.reference_module.BlockPool(num_blocks, enable_caching=caching)
        self.ready = True

    @rule(n=st.integers(-1, 11))
    def allocate(self, n: int) -> None:
        self.both(f"allocate({n})", lambda p: p.allocate(n))

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        page = data.draw(self.pages())
        self.both(f"touch({page})", lambda p: p.touch(page))

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        held = [page for page in range(self.num_blocks) if self.reference.ref_count(page) > 0]
        from_held = data.draw(st.booleans())
        if held and from_held:
            pages = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True))
        else:
            pages = data.draw(st.lists(self.pages(), max_size=4))  # often misuse: must change nothing
        self.both(f"free({pages})", lambda p: p.free(pages))

    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        page = data.draw(self.pages())
        key = data.draw(st.sampled_from(KEYS))
        self.both(f"cache({page}, {key!r})", lambda p: p.cache(page, key))

    @invariant()
    def same_state(self) -> None:
        if not self.ready:
            return
        for name in ("num_blocks", "num_free", "num_cached", "num_cached_free", "num_cached_pinned"):
            assert getattr(self.subject, name) == getattr(self.reference, name), name
        for page in range(self.num_blocks):
            assert self.subject.ref_count(page) == self.reference.ref_count(page), page
            assert self.subject.is_cached(page) == self.reference.is_cached(page), page
        for key in KEYS:
            assert self.subject.lookup(key) == self.reference.lookup(key), key
        assert repr(self.subject) == repr(self.reference)


def pool_machine(subject: ModuleType, reference: ModuleType) -> type[PoolMachine]:
    """A PoolMachine comparing ``subject`` against ``reference``."""
    return type(
        f"PoolMachine_{subject.__name__.replace('.', '_')}",
        (PoolMachine,),
        {"subject_module": subject, "reference_module": reference},
    )


# ------------------------------------------------------------------------------------------------
# The test cases
# ------------------------------------------------------------------------------------------------

# Hashing is stateless; the machines take their hashes from the reference, so check the native
# hash functions against it directly on random inputs.

priors = st.one_of(st.just(""), st.binary(min_size=1, max_size=40).map(bytes.hex))
keys = st.lists(st.text(st.characters(exclude_categories=["Cs"]), max_size=6), max_size=3)
u32s = st.integers(0, 2**32 - 1)


@settings(max_examples=NATIVE_EXAMPLES, deadline=None)
@given(tokens=st.lists(u32s, max_size=40), page_size=st.integers(1, 8), prior=priors, extra=keys)
def test_hashing_native_matches_reference(
    tokens: list[int], page_size: int, prior: str, extra: list[str]
) -> None:
    assert NATIVE.hash_page(tokens, prior, extra) == REFERENCE.hash_page(tokens, prior, extra)
    native = NATIVE.hash_pages(tokens, page_size, prior=prior, extra_keys=extra)
    assert native == REFERENCE.hash_pages(tokens, page_size, prior=prior, extra_keys=extra)


@settings(max_examples=NATIVE_EXAMPLES, deadline=None)
@given(count=st.integers(0, 12), first_base=st.integers(0, 9), m=st.integers(1, 5), group=u32s)
def test_folding_native_matches_reference(count: int, first_base: int, m: int, group: int) -> None:
    hashes = [REFERENCE.hash_page([i]) for i in range(count)]
    folded = REFERENCE.fold_hashes(hashes, first_base, m)
    assert NATIVE.fold_hashes(hashes, first_base, m) == folded
    for h in folded:
        assert NATIVE.group_key(h, group) == REFERENCE.group_key(h, group)


TestEngineNativeVsReference = engine_machine(flat_kvcache, REFERENCE).TestCase
TestEngineNativeVsReference.settings = machine_settings(NATIVE_EXAMPLES, steps=50)

TestPoolNativeVsReference = pool_machine(flat_kvcache, REFERENCE).TestCase
TestPoolNativeVsReference.settings = machine_settings(NATIVE_EXAMPLES, steps=50)

TestEngineReferenceSanity = engine_machine(REFERENCE, REFERENCE).TestCase
TestEngineReferenceSanity.settings = machine_settings(SANITY_EXAMPLES, steps=50)

TestPoolReferenceSanity = pool_machine(REFERENCE, REFERENCE).TestCase
TestPoolReferenceSanity.settings = machine_settings(SANITY_EXAMPLES, steps=30)
