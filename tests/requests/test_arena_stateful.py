"""Stateful cross-check of the token-level API over the SPEC 13 storage (``FlatKVCache(arena=)``).

The request machine of tests/requests/test_requests_stateful.py (every rule: add, admit, append,
schedule, next_chunk, reserve, finish, preempt and re-add, reset, block tables, misuse), with
both engines' pages laid out in the same arena: random unit sizes, page groups whose pages
divide the unit or straddle units, at most one state group (a state page is a whole unit, its
page size the checkpoint grain), 1 to 11 usable units so units run out, are evicted whole and
are rebound to other groups. After every step both engines must agree on every return value or
exception, page ids (view indices of each group), positions, ``stats()``, ``budget()`` (arena
credits), ``take_events()`` (replayed into a router's index: exactly the cached pages),
``arena_stats()``, and the step's ``state_slots``; both pass ``check_invariants()``, which in
arena mode checks every unit's lists and counts.

``HYPOTHESIS_PROFILE=ci`` runs 500 examples.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from machines import ArenaRequestsMachine
from strategies import examples

EXAMPLES = examples(dev=100, ci=500, variable="ARENA_EXAMPLES")
STEPS = 50


ArenaRequestsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestArenaCrossCheck = ArenaRequestsMachine.TestCase
