"""The SPEC 13 arena driven by the engine: a data proof without a model.

A runner writes K/V and recurrent state through :func:`allocate_arena`'s views at exactly the
page ids (``page_ids``) and state slots (``state_slots``) that ``FlatKVCache(arena=plan)``
hands out, step by step, as a model runner would; a small deterministic "model" written here
gives every value independently of the engine: K/V of position ``i`` is a function of the
layer and of a hash of the tokens up to ``i``, and the state after ``c`` tokens is
``s = advance(s, token)`` replayed over them. The arena starts NaN-poisoned (unit 0, the null
page and slot, stays zeros). Proved:

- every read of a step (its read state slot, and the K/V of every position before its last
  token through the request's page table) equals the model's value: no read sees poison, a
  value another group, layer or request wrote, or a stale one;
- pages and slots of units nothing wrote yet are still poison when first handed out;
- a prefix hit restores exactly the checkpoint (state after the hit's last token, a whole
  number of grains) and the K/V pages the first request wrote;
- under memory pressure (units evicted and rebound between the K/V group and the state
  group, requests preempted and re-added) the same holds after every step, with
  ``check_invariants()`` passing;
- the comparison can fail: a shifted state slot or page id, or a skipped copy, is caught.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from helpers import missing, small_arena_hybrid

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
import flat_kvcache.reference
from flat_kvcache import ArenaPlan, KVCacheSpec
from flat_kvcache.torch import ArenaBuffers, ModelShape, allocate_arena

pytestmark = pytest.mark.torch

#: Tokens per K/V page (the plan's page size) and the state group's checkpoint grain.
P = 4
G = 8
FULL = "full_attention"
STATE = "linear_attention"
MASK = (1 << 61) - 1

ENGINES = [
    pytest.param(flat_kvcache, id="native"),
    pytest.param(flat_kvcache.reference, id="reference"),
]


def hybrid() -> ModelShape:
    """The small hybrid of the arena data tests (``helpers.small_arena_hybrid``)."""
    shape: ModelShape = small_arena_hybrid()
    return shape


# --- the model: K/V and state from the tokens alone ---------------------------------------------


def chain(prefix_hash: int, token: int) -> int:
    return (prefix_hash * 1_000_003 + token + 1) & MASK


def advance(state: torch.Tensor, increment: torch.Tensor) -> torch.Tensor:
    """The state after one more token (the "recurrence"), in the state's own dtype."""
    return (state.float() * 0.5 + increment).to(state.dtype)


class Model:
    """The values a model would compute, from tokens only (memoized, never read from the arena)."""

    def __init__(self, shape: ModelShape) -> None:
        assert shape.state_shapes is not None and shape.state_dtypes is not None
        self.shape = shape
        self.attention = [i for i, t in enumerate(shape.layer_types) if t == FULL]
        self.states = [
            (i, c) for i, t in enumerate(shape.layer_types) if t == STATE for c in shape.state_shapes
        ]
        self._kv: dict[tuple[int, int], torch.Tensor] = {}
        self._increment: dict[tuple[int, str, int], torch.Tensor] = {}

    def kv(self, layer: int, prefix_hash: int) -> torch.Tensor:
        """K and V (``[2, heads, head_dim]``) of the last token of the prefix with this hash."""
        key = (layer, prefix_hash)
        if key not in self._kv:
            gen = torch.Generator().manual_seed((prefix_hash * 131 + layer) & MASK)
            heads, dim = self.shape.num_kv_heads, self.shape.head_dim
            self._kv[key] = (torch.rand((2, heads, dim), generator=gen) + 1.0).to(self.shape.kv_dtype)
        return self._kv[key]

    def increment(self, layer: int, component: str, token: int) -> torch.Tensor:
        key = (layer, component, token)
        if key not in self._increment:
            assert self.shape.state_shapes is not None
            gen = torch.Generator().manual_seed((token * 7919 + layer * 131 + len(component)) & MASK)
            dims = self.shape.state_shapes[component]
            self._increment[key] = torch.rand(dims, generator=gen) * 2.0 - 1.0
        return self._increment[key]

    def zero_state(self) -> dict[tuple[int, str], torch.Tensor]:
        assert self.shape.state_shapes is not None and self.shape.state_dtypes is not None
        return {
            (layer, c): torch.zeros(self.shape.state_shapes[c], dtype=self.shape.state_dtypes[c])
            for layer, c in self.states
        }


@dataclass
class Truth:
    """The model's values for one token sequence: K/V per position, state after each count."""

    model: Model
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    states: list[dict[tuple[int, str], torch.Tensor]] = field(default_factory=list)

    def extend(self, tokens: list[int]) -> None:
        if not self.states:
            self.states.append(self.model.zero_state())
        for token in tokens:
            self.hashes.append(chain(self.hashes[-1] if self.hashes else 0, token))
            last = self.states[-1]
            self.states.append(
                {key: advance(s, self.model.increment(*key, token)) for key, s in last.items()}
            )
            self.tokens.append(token)

    def kv(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``start .. end - 1``: ``[n, heads, head_dim]`` each."""
        both = torch.stack([self.model.kv(layer, h) for h in self.hashes[start:end]])
        return both[:, 0], both[:, 1]


def differs(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when equal (exactly); else what differs (NaN poison counts as a difference)."""
    if got.shape == want.shape and torch.equal(got, want):
        return None
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan = int(torch.isnan(got.float()).sum())
    wrong = int((got != want).sum())
    return f"{wrong} of {got.numel()} elements differ ({nan} NaN)"


# --- the runner ---------------------------------------------------------------------------------


class Runner:
    """A model runner without a model: the engine over an arena plan, the arena's views, and
    the truth of every live request (by slot)."""

    def __init__(self, engine: ModuleType, num_units: int) -> None:
        self.shape = hybrid()
        self.model = Model(self.shape)
        components = self.shape.components()
        unit = flat_kvcache.plan_arena(components, P, 1 << 30).unit_bytes
        self.plan: ArenaPlan = flat_kvcache.plan_arena(components, P, num_units * unit)
        assert [g.group_id for g in self.plan.groups] == [FULL, STATE]
        self.arena: ArenaBuffers = allocate_arena(self.shape, self.plan, "cpu")
        # poison: 0xFF bytes are NaN in bf16 and fp32; unit 0 (null page and slot) stays zeros
        self.arena.arena[self.plan.unit_bytes :].fill_(0xFF)
        specs = [KVCacheSpec("full", P, group_id=FULL), KVCacheSpec("state", G, group_id=STATE)]
        self.cache = engine.FlatKVCache(specs, arena=self.plan, enable_caching=True)
        self.full = list(self.cache.group_ids).index(FULL)
        self.live: dict[int, Truth] = {}
        #: units written so far (any group): a unit outside it must still be poison
        self.touched: set[int] = set()
        #: units seen bound to each group (a unit in both was rebound)
        self.units_seen: dict[str, set[int]] = {FULL: set(), STATE: set()}
        self.reads = {"state": 0, "checkpoint": 0, "kv_tokens": 0, "fresh": 0}

    # -- requests --------------------------------------------------------------------------------

    def add(self, req: str, tokens: list[int]) -> tuple[int, int]:
        slot, hit = (int(x) for x in self.cache.add_request(req, tokens))
        assert hit % G == 0 and hit <= len(tokens) - 1, (req, hit)
        truth = Truth(self.model)
        truth.extend(tokens)
        self.live[slot] = truth
        assert self.cache.num_computed_tokens(slot) == hit
        return slot, hit

    def finish(self, slot: int) -> None:
        self.cache.finish([slot])
        del self.live[slot]

    def preempt(self, slot: int) -> list[int]:
        (tokens,) = self.cache.preempt([slot])
        assert list(tokens) == self.live.pop(slot).tokens
        return list(tokens)

    def append(self, slot: int, token: int) -> None:
        self.cache.append_tokens([slot], [token])
        self.live[slot].extend([token])

    # -- a step ------------------------------------------------------------------------------------

    def schedule(self, slot: int, n: int) -> bool:
        return bool(self.cache.schedule([slot], [n])[0])

    def slots(self, slot: int, n: int) -> tuple[int, int]:
        read, write = self.cache.state_slots([slot], [n])
        return int(read[0]), int(write[0])

    def latest_state(self, slot: int) -> int:
        """The state slot holding the request's state after its computed tokens: the page of
        the state group's table in the slot of its last computed token (0 before any)."""
        computed = self.cache.num_computed_tokens(slot)
        if computed == 0:
            return 0
        pages = self.cache.page_ids(slot)[list(self.cache.group_ids).index(STATE)]
        return int(pages[(computed - 1) // G])

    def table(self, slot: int, tokens: int) -> list[int]:
        """The K/V page of every position ``< tokens`` of the request (never a hole)."""
        pages = [int(p) for p in self.cache.page_ids(slot)[self.full]]
        needed = pages[: -(-tokens // P)]
        assert len(needed) == -(-tokens // P) and all(needed), (pages, tokens)
        return needed

    def state_problem(self, slot: int, want: dict[tuple[int, str], torch.Tensor]) -> str | None:
        """None when every state component of ``slot`` equals ``want``; else the first difference."""
        for layer, component in self.model.states:
            problem = differs(self.arena.state(layer, component)[slot], want[(layer, component)])
            if problem is not None:
                return f"state slot {slot} layer {layer} {component}: {problem}"
        return None

    def kv_problem(self, table: list[int], truth: Truth, tokens: int) -> str | None:
        """None when K and V of positions ``< tokens``, gathered through ``table``, equal the truth."""
        pages = torch.tensor([table[t // P] for t in range(tokens)], dtype=torch.long)
        offsets = torch.arange(tokens) % P
        for layer in self.model.attention:
            want_k, want_v = truth.kv(layer, 0, tokens)
            for name, view, want in (("K", self.arena.k(layer), want_k), ("V", self.arena.v(layer), want_v)):
                problem = differs(view[pages, offsets], want)
                if problem is not None:
                    return f"{name} of layer {layer} through {table}: {problem}"
        return None

    def is_poison_state(self, slot: int) -> bool:
        return all(
            bool(torch.isnan(self.arena.state(layer, c)[slot].float()).all())
            for layer, c in self.model.states
        )

    def is_poison_page(self, page: int) -> bool:
        return all(
            bool(torch.isnan(view[page].float()).all())
            for layer in self.model.attention
            for view in (self.arena.k(layer), self.arena.v(layer))
        )

    def run(self, slot: int, n: int) -> tuple[int, int]:
        """The data of a step that ``schedule`` gave ``n`` tokens: check what it reads, write
        what it computes (K/V of the new positions, the state after them). Returns (read, write)."""
        truth = self.live[slot]
        end = self.cache.num_computed_tokens(slot)
        start = end - n
        read, write = self.slots(slot, n)
        self.units_seen[STATE].add(write)
        assert write != 0, "a step never writes the null slot"
        # the read: the state after token start - 1 (zeros at 0), never poison
        problem = self.state_problem(read, truth.states[start])
        assert problem is None, f"step {start}..{end}: read {problem}"
        self.reads["state"] += 1
        if start > 0 and read != write:
            self.reads["checkpoint"] += 1
        if read != write:
            if write not in self.touched:
                assert self.is_poison_state(write), f"fresh state slot {write} was written by someone"
                self.reads["fresh"] += 1
            for layer, component in self.model.states:
                view = self.arena.state(layer, component)
                view[write] = view[read]
        # the step in place on the write slot
        for token in truth.tokens[start:end]:
            for layer, component in self.model.states:
                view = self.arena.state(layer, component)
                view[write] = advance(view[write], self.model.increment(layer, component, token))
        self.touched.add(write)
        # K/V of the new positions at (page, offset); a page of an untouched unit is poison
        table = self.table(slot, end)
        new_pages = sorted({table[t // P] for t in range(start, end)})
        for page in new_pages:
            unit = self.arena.unit_of(FULL, page)
            self.units_seen[FULL].add(unit)
            if unit not in self.touched:
                assert self.is_poison_page(page), f"fresh K/V page {page} was written by someone"
                self.reads["fresh"] += 1
        pages = torch.tensor([table[t // P] for t in range(start, end)], dtype=torch.long)
        offsets = torch.arange(start, end) % P
        for layer in self.model.attention:
            k, v = truth.kv(layer, start, end)
            self.arena.k(layer)[pages, offsets] = k
            self.arena.v(layer)[pages, offsets] = v
        self.touched.update(self.arena.unit_of(FULL, page) for page in new_pages)
        # attention reads every position up to the last new one through the page table
        problem = self.kv_problem(table, truth, end)
        assert problem is None, f"step {start}..{end}: {problem}"
        self.reads["kv_tokens"] += end
        return read, write

    def step(self, slot: int, max_tokens: int) -> int:
        """One prefill chunk cut by ``next_chunk`` (a checkpoint lands where it ends on a grain)."""
        n = int(self.cache.next_chunk(slot, max_tokens))
        assert n > 0
        assert self.schedule(slot, n), "the arena is too small for this test"
        self.run(slot, n)
        self.check()
        return n

    def decode(self, slot: int, token: int) -> None:
        self.append(slot, token)
        assert self.cache.next_chunk(slot, 16) == 1
        assert self.schedule(slot, 1)
        self.run(slot, 1)
        self.check()

    def batch(self, slots: list[int], max_tokens: int) -> list[tuple[int, int]]:
        """One batched step: every request's next chunk, scheduled in one call; (read, write) each."""
        ns = [int(self.cache.next_chunk(slot, max_tokens)) for slot in slots]
        assert all(ns) and self.cache.schedule(slots, ns).all()
        got = [self.run(slot, n) for slot, n in zip(slots, ns, strict=True)]
        self.check()
        return got

    def prefill(self, slot: int, max_tokens: int) -> None:
        while self.cache.num_computed_tokens(slot) < self.cache.num_tokens(slot):
            self.step(slot, max_tokens)

    def check(self) -> None:
        """The engine's invariants, and the data of every live request: K/V of its computed
        tokens and its latest state (the slot of its last computed token)."""
        self.cache.check_invariants()
        for slot, truth in self.live.items():
            computed = self.cache.num_computed_tokens(slot)
            if computed:
                problem = self.kv_problem(self.table(slot, computed), truth, computed)
                assert problem is None, f"live slot {slot}: {problem}"
            problem = self.state_problem(self.latest_state(slot), truth.states[computed])
            assert problem is None, f"live slot {slot} at {computed}: {problem}"


def tokens(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, 50_000, (n,), generator=gen)]


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_values_written_at_the_engines_ids_read_back_at_a_prefix_hit(engine: ModuleType) -> None:
    run = Runner(engine, num_units=32)
    prompt_a = tokens(1, 50)
    a, hit = run.add("A", prompt_a)
    assert (a, hit) == (0, 0)
    # chunks of at most 12 tokens cut on the grain: 8 at a time, then the tail 2
    assert [run.step(a, 12) for _ in range(7)] == [8] * 6 + [2]
    # decode 8 tokens (positions 50..57): in place on the tail's slot up to 55; the step that
    # ended at 56 left the request's decode checkpoint (SPEC 13.5d: its latest), so the step of
    # position 56 reads it and writes a new slot
    for i in range(8):
        run.decode(a, 900 + i)
    # every chunk after the first (8, 16, ..., 48), and the decode step at 56, started from one
    assert run.reads["fresh"] > 0 and run.reads["checkpoint"] == 7
    run.finish(a)
    run.check()
    assert run.cache.stats()["checkpoints_written"] >= 6

    # C: A's prompt and decoded tokens as a prompt (the conversation's next turn): the deepest
    # checkpoint is the one A's decode left at 56
    prompt_c = prompt_a + [900 + i for i in range(8)] + [5]
    c, hit = run.add("C", prompt_c)
    assert hit == 7 * G
    run.prefill(c, 12)
    run.decode(c, 1)
    run.finish(c)
    run.check()

    # D: exactly A's first 6 grains: the hit leaves the last token to compute, so it stops at
    # the checkpoint of 40 and the last grain is recomputed into new pages
    d, hit = run.add("D", prompt_a[: 6 * G])
    assert hit == 5 * G
    assert run.step(d, 12) == G
    run.finish(d)
    run.check()

    # B shares A's first 3 grains (24 tokens) and then diverges
    prompt_b = prompt_a[: 3 * G] + tokens(2, 20)
    b, hit = run.add("B", prompt_b)
    assert hit == 3 * G
    truth_b = run.live[b]
    # before B's first step: the hit's pages hold A's K/V, its checkpoint A's state after 24
    assert run.kv_problem(run.table(b, hit), truth_b, hit) is None
    n = int(run.cache.next_chunk(b, 12))
    assert run.schedule(b, n)
    read, write = run.run(b, n)
    assert read != 0 and read != write, "B starts from A's checkpoint and never writes into it"
    assert run.state_problem(read, truth_b.states[hit]) is None, "the checkpoint is left as it was"
    run.check()
    run.prefill(b, 12)
    for i in range(2):
        run.decode(b, 700 + i)
    run.finish(b)
    run.check()
    assert run.cache.stats()["checkpoints_hit"] == 3
    assert run.arena.unit(0).count_nonzero() == 0, "unit 0 stays zeros"


@pytest.mark.parametrize("engine", ENGINES)
def test_live_requests_share_a_checkpoint_and_each_copies_it_out(engine: ModuleType) -> None:
    run = Runner(engine, num_units=40)
    prompt_a = tokens(5, 40)
    a, _ = run.add("A", prompt_a)
    for _ in range(3):
        run.step(a, 8)
    # A is still running: B and C hit its checkpoint at 16 (registered by its last schedule)
    b, hit_b = run.add("B", prompt_a[: 2 * G] + tokens(6, 15))
    c, hit_c = run.add("C", prompt_a[: 2 * G] + tokens(7, 9))
    assert hit_b == hit_c == 2 * G
    (_, write_a), (read_b, write_b), (read_c, write_c) = run.batch([a, b, c], 8)
    assert read_b == read_c != 0, "both start from the same checkpoint slot"
    assert len({read_b, write_a, write_b, write_c}) == 4, "and each writes its own slot"
    assert run.state_problem(read_b, run.live[b].states[2 * G]) is None
    # mixed batches of prefill chunks and decodes until each has decoded 4 tokens
    target = {slot: len(run.live[slot].tokens) + 4 for slot in (a, b, c)}
    while run.live:
        for slot in list(run.live):
            if run.cache.num_computed_tokens(slot) == target[slot]:
                run.finish(slot)
            elif run.cache.num_computed_tokens(slot) == run.cache.num_tokens(slot):
                run.append(slot, 300 + slot)
        if run.live:
            run.batch(sorted(run.live), 12)
    run.check()
    assert run.cache.stats()["checkpoints_hit"] == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_a_shifted_slot_or_page_id_fails_the_comparison(engine: ModuleType) -> None:
    run = Runner(engine, num_units=32)
    prompt_a = tokens(3, 40)
    a, _ = run.add("A", prompt_a)
    run.prefill(a, 8)
    run.finish(a)
    b, hit = run.add("B", prompt_a[: 2 * G] + tokens(4, 12))
    assert hit == 2 * G
    truth = run.live[b]
    n = int(run.cache.next_chunk(b, 8))
    assert run.schedule(b, n)
    read, write = run.slots(b, n)
    table = run.table(b, hit)
    assert read not in (0, write)

    # the right ids pass
    assert run.state_problem(read, truth.states[hit]) is None
    assert run.kv_problem(table, truth, hit) is None
    # a shifted state slot: a neighbour (another checkpoint of A, poison or the null slot),
    # the write slot before the copy (fresh: poison), the null slot
    for wrong in (read - 1, read + 1, write, 0):
        assert run.state_problem(wrong, truth.states[hit]) is not None, wrong
    assert run.is_poison_state(write), "skipping the copy would run the step on poison"
    # A's checkpoint one grain earlier is finite but the wrong state
    assert run.state_problem(read, truth.states[hit - G]) is not None
    # a shifted page id, anywhere in the table, or two pages swapped
    num_ids = run.arena.groups[FULL].num_ids
    for j in range(len(table)):
        shifted = list(table)
        shifted[j] = (shifted[j] + 1) % num_ids
        assert run.kv_problem(shifted, truth, hit) is not None, (j, shifted)
    swapped = [table[1], table[0], *table[2:]]
    assert run.kv_problem(swapped, truth, hit) is not None
    # the K/V is per position: one token off reads another token's values
    assert run.kv_problem(table, truth, hit - 1) is None
    pages = torch.tensor([table[(t + 1) // P] for t in range(hit - 1)])
    offsets = (torch.arange(hit - 1) + 1) % P
    layer = run.model.attention[0]
    assert differs(run.arena.k(layer)[pages, offsets], truth.kv(layer, 0, hit - 1)[0]) is not None

    # and the honest step still passes after all those reads
    run.run(b, n)
    run.check()


@pytest.mark.parametrize("engine", ENGINES)
def test_memory_pressure_evicts_rebinds_and_preempts_without_losing_a_value(engine: ModuleType) -> None:
    run = Runner(engine, num_units=12)
    cache = run.cache

    # preempted mid-prefill after a chunk that ended on a grain: re-added at its checkpoint
    first = tokens(10, 30)
    s, _ = run.add("first", first)
    assert run.step(s, 8) == G
    run.preempt(s)
    run.check()
    s, hit = run.add("first", first)
    assert hit == G
    n = int(cache.next_chunk(s, 8))
    assert run.schedule(s, n)
    read, _ = run.run(s, n)
    assert read != 0, "the first step after the re-add reads the checkpoint at G"
    run.check()
    run.finish(s)

    # preempted after a chunk that ended inside a grain (no checkpoint): re-added from scratch,
    # its first step reads the null slot
    second = tokens(11, 20)
    s, _ = run.add("second", second)
    assert run.schedule(s, 5)
    run.run(s, 5)
    run.preempt(s)
    s, hit = run.add("second", second)
    assert hit == 0
    n = int(cache.next_chunk(s, 8))
    assert run.schedule(s, n)
    read, _ = run.run(s, n)
    assert read == 0
    run.check()
    run.finish(s)
    run.check()

    # a mix sharing prefixes, three at a time, in an arena too small for them
    system = tokens(12, 2 * G)
    work: deque[tuple[str, list[int], int]] = deque()
    for i in range(10):
        # every third prompt on its own, the others after the shared system prefix
        own = tokens(100 + i, 18 + (3 * i) % 11) if i % 3 == 0 else tokens(100 + i, 6 + (5 * i) % 17)
        prompt = own if i % 3 == 0 else system + own
        work.append((f"r{i}", prompt, 2 + i % 3))
    running: list[tuple[str, int]] = []  # (id, slot), oldest first
    left: dict[str, int] = {}
    hits = 0
    re_added = 0
    steps = 0
    while work or running:
        steps += 1
        assert steps < 500
        while work and len(running) < 3:
            req, prompt, out = work.popleft()
            if req in left:
                re_added += 1
            left[req] = out
            slot, hit = run.add(req, prompt)
            hits += hit > 0
            running.append((req, slot))
            run.check()
        for req, slot in list(running):
            if (req, slot) not in running:
                continue  # preempted earlier in this step
            computed, known = cache.num_computed_tokens(slot), cache.num_tokens(slot)
            if computed == known:
                if left[req] == 0:
                    run.finish(slot)
                    running.remove((req, slot))
                    run.check()
                    continue
                run.append(slot, 1000 + computed)
                left[req] -= 1
            n = int(cache.next_chunk(slot, 8 if steps % 2 else 12))
            while not run.schedule(slot, n):
                victims = [r for r in running if r != (req, slot)]
                assert victims, "the arena must hold one request alone"
                victim_req, victim_slot = victims[-1]
                work.appendleft((victim_req, run.preempt(victim_slot), left[victim_req]))
                running.remove((victim_req, victim_slot))
                run.check()
            run.run(slot, n)
            run.check()

    stats = cache.stats()
    assert stats["evictions"] > 0, stats
    assert stats["preemptions"] > 2 and re_added > 0, stats
    assert hits > 0 and stats["checkpoints_hit"] > 0, stats
    rebound = run.units_seen[FULL] & run.units_seen[STATE]
    assert rebound, "no unit was rebound between the K/V group and the state group"
    assert run.arena.unit(0).count_nonzero() == 0
    arena = cache.arena_stats()
    assert arena is not None and arena["units_total"] == run.plan.num_units - 1
