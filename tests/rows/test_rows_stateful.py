"""Stateful cross-check of persistent block-table rows (docs/requests-api.md "Persistent rows").

One hypothesis state machine drives the native ``FlatKVCache`` and the pure-Python reference
with the same scheduler-loop operations on requests whose slots are rows of bound buffers (row
``s`` is the request in slot ``s``): add (the lowest free slot, refused when every row is held),
decode steps (``schedule`` + ``append_tokens`` on slot arrays), calls on any slots (free ones,
repeats, too many tokens), prefill chunks, finish, preempt and re-add (the lowest free slot
again), ``reset_prefix_cache``, re-binding (fewer or more rows, other widths, windowed sliding
groups; fewer rows than a live slot needs is refused), a scribble repaired by
``update_rows(full=True)``, and bound buffers changed in place (read-only, another dtype,
another shape), which both engines must refuse without writing or losing anything.

After every ``update_rows`` the two engines must return the same deltas (or raise the same
exception class), and the deltas, applied to a shadow copy that only ever sees deltas, must
give the bound buffers; each live request's row must be exactly its ``block_tables`` row (a
windowed row: ``cols`` slots of it from ``offsets[row]``, with no real page before that slot and
the table ending within the row) and every other row padding.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from slots import lowest_free, outcome_of
from strategies import DOCUMENTS, REQUEST_IDS, both_caches, configs, examples

EXAMPLES = examples(dev=60, ci=300, variable="ROWS_EXAMPLES")


class RowsMachine(RuleBasedStateMachine):
    """Native and reference caches with bound rows; deltas must agree and be exact."""

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[Any] = []
        self.live: dict[Any, int] = {}  # request -> slot (its row)
        self.bound_buffers: list[dict[str, np.ndarray]] = []
        self.bound_offsets: list[dict[str, np.ndarray]] = []

    @initialize(
        # Every config has a sliding group, so windowed rows are exercised (full and state
        # groups come alongside).
        config=configs().filter(lambda c: any(kind == "sliding_window" for kind, _, _ in c["groups"])),
        max_rows=st.integers(1, 5),
        cols=st.integers(1, 40),
        windowed=st.sampled_from([0, 2, 4, 6, 10, 16]),
    )
    def build(self, config: dict[str, Any], max_rows: int, cols: int, windowed: int) -> None:
        self.config = config
        self.caches.extend(both_caches(config))
        self.group_ids = self.caches[0].group_ids
        self.kinds = [kind for kind, _, _ in config["groups"]]
        self.max_rows = max_rows
        self.bind(max_rows, cols, windowed)

    # -- helpers ------------------------------------------------------------------------------

    def bind(self, max_rows: int, cols: int, windowed: int) -> None:
        """Bind fresh buffers (the same shapes) to both caches; both must agree. ``windowed``:
        0, or the width of every sliding group's windowed rows."""
        self.buffers: list[dict[str, np.ndarray]] = []
        self.offsets: list[dict[str, np.ndarray]] = []
        outcomes = []
        for cache in self.caches:
            tables = {
                g: np.full(
                    (max_rows, windowed if windowed and kind == "sliding_window" else cols + i), 7, np.int32
                )
                for i, (g, kind) in enumerate(zip(self.group_ids, self.kinds, strict=True))
            }
            offsets = {
                g: np.full(max_rows, 7, np.int32)
                for g, kind in zip(self.group_ids, self.kinds, strict=True)
                if windowed and kind == "sliding_window"
            }
            try:
                cache.bind_rows(tables, offsets=offsets)
                outcomes.append("ok")
            except ValueError as exc:
                outcomes.append(str(exc))
            self.buffers.append(tables)
            self.offsets.append(offsets)
        assert outcomes[0] == outcomes[1], outcomes
        # Refused exactly when a live slot has no row in the new tables, naming the lowest.
        too_high = sorted((slot, req) for req, slot in self.live.items() if slot >= max_rows)
        if too_high:
            slot, req = too_high[0]
            assert outcomes[0] == (
                f"bind_rows: request {req!r} holds slot {slot}, but the new tables have {max_rows} rows"
            ), outcomes[0]
        else:
            assert outcomes[0] == "ok", outcomes[0]
        self.max_rows = max_rows if outcomes[0] == "ok" else self.max_rows
        if outcomes[0] != "ok":
            event("rebind refused")
            self.buffers, self.offsets = self.bound_buffers, self.bound_offsets
            return
        for tables, offsets in zip(self.buffers, self.offsets, strict=True):
            assert all((t == -1).all() for t in tables.values()), "bind_rows fills tables with -1"
            assert all((o == 0).all() for o in offsets.values()), "bind_rows fills offsets with 0"
        self.bound_buffers, self.bound_offsets = self.buffers, self.offsets
        # The engine's device copy, kept only through deltas (a fresh binding starts as padding).
        self.shadow = {g: t.copy() for g, t in self.buffers[0].items()}
        self.shadow_offsets = {g: o.copy() for g, o in self.offsets[0].items()}

    def both(self, method: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """``method`` on both caches: the same result, or the same exception class and message."""
        outcomes = [outcome_of(partial(getattr(cache, method), *args, **kwargs)) for cache in self.caches]
        assert outcomes[0] == outcomes[1], f"{method}{args}: {outcomes}"
        return outcomes[0]

    def pick(self, index: int) -> Any:
        return list(self.live)[index % len(self.live)]

    def remaining(self, slot: int) -> int:
        native = self.caches[0]
        return int(native.num_tokens(slot) - native.num_computed_tokens(slot))

    def add(self, req: Any, prompt: list[int]) -> None:
        """``add_request``: the lowest free slot, or refused when every bound row is held."""
        outcome = self.both("add_request", req, prompt)
        if req in self.live:
            assert outcome == ("raise", f"ValueError: add_request: request {req!r} already exists"), outcome
            return
        if len(self.live) >= self.max_rows:
            assert outcome == (
                "raise",
                f"ValueError: add_request: all {self.max_rows} slots of the bound rows are held "
                "(finish a request or bind more rows)",
            ), outcome
            event("add_request refused: every row held")
            return
        assert outcome[0] == "ok", outcome
        assert outcome[1][0] == lowest_free(self.live.values()), outcome
        self.live[req] = outcome[1][0]

    # -- rules --------------------------------------------------------------------------------

    @rule(req=st.sampled_from(REQUEST_IDS), doc=st.integers(0, 2), length=st.integers(1, 40))
    def add_request(self, req: Any, doc: int, length: int) -> None:
        self.add(req, DOCUMENTS[doc][:length])

    @rule(
        req=st.sampled_from(REQUEST_IDS),
        doc=st.integers(0, 2),
        length=st.integers(1, 40),
        limit=st.integers(0, 48),
    )
    def admit(self, req: Any, doc: int, length: int, limit: int) -> None:
        """``admit`` answers None while every bound row is held, and changes nothing."""
        if req in self.live:
            return
        outcome = self.both("admit", req, DOCUMENTS[doc][:length], limit)
        assert outcome[0] == "ok", outcome
        if len(self.live) >= self.max_rows:
            assert outcome[1] is None, f"admit added a request with every row held: {outcome}"
            event("admit: every row held")
        elif outcome[1] is not None:
            assert outcome[1][0] == lowest_free(self.live.values()), outcome
            self.live[req] = outcome[1][0]

    @precondition(lambda self: self.live)
    @rule(tokens=st.lists(st.integers(0, 2000), min_size=1, max_size=5), as_array=st.booleans())
    def decode_step(self, tokens: list[int], as_array: bool) -> None:
        """One decode step for up to 5 live requests: schedule one token each, then append one
        each (slots as a list, or as numpy arrays)."""
        slots = [s for s in self.live.values() if self.remaining(s) >= 1][: len(tokens)]
        if not slots:
            return
        if as_array:
            array = np.array(slots, dtype=np.int64)
            self.both("schedule", array, np.ones(len(slots), np.int64))
            self.both("append_tokens", array, np.array(tokens[: len(slots)], dtype=np.uint32))
        else:
            self.both("schedule", slots, [1] * len(slots))
            self.both("append_tokens", slots, tokens[: len(slots)])

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), steps=st.integers(1, 24))
    def long_decode(self, index: int, steps: int) -> None:
        """Run one request to the end of its prompt, then decode ``steps`` tokens with an update
        after each, so tables grow past windowed rows and slide."""
        slot = self.live[self.pick(index)]
        self.both("schedule", [slot], [self.remaining(slot)])
        for token in range(steps):
            self.both("append_tokens", [slot], [token])
            if self.both("schedule", [slot], [1]) != ("ok", ("ndarray", "bool", (1,), [True])):
                return
            self.update()

    @rule(slots=st.lists(st.integers(0, 6), max_size=4), counts=st.lists(st.integers(0, 3), max_size=4))
    def any_slots(self, slots: list[int], counts: list[int]) -> None:
        """Slot-addressed calls with any slots and counts: free slots, repeats, too many tokens."""
        outcome = self.both("schedule", slots, counts)
        if outcome[0] == "raise":
            event("schedule refused")
        self.both("append_tokens", slots, list(range(sum(counts))), counts)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), fraction=st.floats(0, 1))
    def prefill_chunk(self, index: int, fraction: float) -> None:
        slot = self.live[self.pick(index)]
        self.both("schedule", [slot], [int(self.remaining(slot) * fraction)])

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 10), preempt=st.booleans(), readd=st.booleans())
    def finish_or_preempt(self, index: int, preempt: bool, readd: bool) -> None:
        """Finish or preempt a request: its slot is free at once (its row goes back to padding on
        the next update); a preempted one may come back, in the lowest free slot."""
        req = self.pick(index)
        slot = self.live.pop(req)
        if not preempt:
            assert self.both("finish", [slot]) == ("ok", None)
            return
        status, (tokens,) = self.both("preempt", [slot])
        assert status == "ok"
        if readd:
            self.add(req, tokens)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.both("reset_prefix_cache")

    @rule(max_rows=st.integers(1, 6), cols=st.integers(1, 40), windowed=st.sampled_from([0, 2, 4, 6, 10, 16]))
    def rebind(self, max_rows: int, cols: int, windowed: int) -> None:
        self.update()  # settle the old binding first; the new one starts over
        self.bind(max_rows, cols, windowed)

    @rule(row=st.integers(0, 5), col=st.integers(0, 40), value=st.integers(-5, 50))
    def scribble(self, row: int, col: int, value: int) -> None:
        """Someone writes a cell of both engines' buffers: a full update must repair it."""
        first = self.buffers[0][self.group_ids[0]]
        if row >= first.shape[0] or col >= first.shape[1]:
            return
        # Only over rows that are up to date (a refused update would leave the scribble there).
        if not self.update():
            return
        for tables in self.buffers:
            tables[self.group_ids[0]][row, col] = value
        self.shadow[self.group_ids[0]][row, col] = value
        self.update(full=True)

    @rule(group=st.integers(0, 5), how=st.sampled_from(["read-only", "dtype", "shape", "offsets read-only"]))
    def tamper(self, group: int, how: str) -> None:
        """Someone changes a bound buffer in place (numpy allows it): both engines must refuse
        the update the same way and write nothing; once the buffer is restored, the next
        update must bring the shadow copy (kept only by deltas) level with the buffers."""
        group_id = self.group_ids[group % len(self.group_ids)]
        if how == "offsets read-only":
            if group_id not in self.offsets[0]:
                return
            arrays = [offs[group_id] for offs in self.offsets]
        else:
            arrays = [tables[group_id] for tables in self.buffers]
        before = [a.copy() for a in arrays]
        for array in arrays:
            if how in ("read-only", "offsets read-only"):
                array.flags.writeable = False
            elif how == "dtype":
                array.dtype = np.dtype(np.uint32)  # type: ignore[misc]  # numpy re-types it in place
            else:
                array.shape = (-1,)
        refused = [self._update(cache, False) for cache in self.caches]
        assert refused[0] == refused[1], refused
        assert refused[0][0] == "raise", f"update_rows accepted a buffer changed in place ({how})"
        event(f"tampered: {how}")
        for array, old in zip(arrays, before, strict=True):
            if how in ("read-only", "offsets read-only"):
                array.flags.writeable = True
            elif how == "dtype":
                array.dtype = np.dtype(np.int32)  # type: ignore[misc]
            else:
                array.shape = old.shape
            np.testing.assert_array_equal(array, old, err_msg="a refused update wrote a buffer")
        self.update()

    @rule()
    def update_rule(self) -> None:
        self.update()

    def update(self, full: bool = False) -> bool:
        """``update_rows`` on both; True if it succeeded (and everything checked out)."""
        outcomes = [self._update(cache, full) for cache in self.caches]
        assert outcomes[0] == outcomes[1], (
            f"update_rows(full={full}): native {outcomes[0]} != reference {outcomes[1]}"
        )
        if outcomes[0][0] == "raise":
            event("update_rows refused")
            return False
        cells, offsets = outcomes[0][1]
        for group_id, (rows, cols, values) in cells.items():
            assert (self.shadow[group_id][rows, cols] != values).all(), "a delta changes its cell"
            self.shadow[group_id][rows, cols] = values
            if len(values):
                event("cells changed")
        for group_id, (rows, values) in offsets.items():
            self.shadow_offsets[group_id][rows] = values
            if len(values):
                event("windowed offsets changed")
        for tables, offs in zip(self.buffers, self.offsets, strict=True):
            for group_id, table in tables.items():
                np.testing.assert_array_equal(self.shadow[group_id], table)
            for group_id, off in offs.items():
                np.testing.assert_array_equal(self.shadow_offsets[group_id], off)
        self.check_rows()
        return True

    @staticmethod
    def _update(cache: Any, full: bool) -> tuple[str, Any]:
        try:
            cells, offsets = cache.update_rows(full=full)
        except Exception as exc:
            return ("raise", f"{type(exc).__name__}: {exc}")
        as_lists = (
            {g: a.tolist() for g, a in cells.items()},
            {g: a.tolist() for g, a in offsets.items()},
        )
        for g, a in cells.items():
            assert a.dtype == np.int32 and a.shape[0] == 3, (g, a.dtype, a.shape)
            keys = list(zip(a[0].tolist(), a[1].tolist(), strict=True))
            assert keys == sorted(set(keys)), "deltas sorted by row, then column, no repeats"
        return ("ok", as_lists)

    def check_rows(self) -> None:
        """Each live request's row is its ``block_tables`` row; every other row is padding."""
        native = self.caches[0]
        tables, offsets = self.buffers[0], self.offsets[0]
        owners = {row: req for req, row in self.live.items()}
        for group_id, table in tables.items():
            cols = table.shape[1]
            for row in range(table.shape[0]):
                want = np.full(cols, -1, np.int32)
                offset = 0
                if row in owners:
                    pages = native.block_tables([row])[group_id][0]
                    if group_id in offsets:
                        offset = int(offsets[group_id][row])
                        assert (pages[:offset] == 0).all(), "no real page before a windowed row"
                        assert len(pages) - offset <= cols, "the table ends within a windowed row"
                    want[: len(pages) - offset] = pages[offset:]
                    assert native.id_of(row) == owners[row]
                np.testing.assert_array_equal(table[row], want, err_msg=f"{group_id} row {row}")
                if group_id in offsets and row not in owners:
                    assert offsets[group_id][row] == 0, "a vacant row shows offset 0"

    @invariant()
    def agree(self) -> None:
        for cache in self.caches:
            cache.check_invariants()
        for req, slot in self.live.items():
            self.both("page_ids", slot)
            assert self.both("slot_of", req) == ("ok", slot)
            assert self.both("id_of", slot) == ("ok", req)


RowsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestRowsCrossCheck = RowsMachine.TestCase
