"""Stateful cross-check of the token-level request API (docs/requests-api.md).

One hypothesis state machine drives the native ``FlatKVCache`` and the pure-Python reference
with the same random scheduler-loop operations on slots: ``add_request`` and ``admit`` (prompts
drawn from a few shared documents so prefix hits happen, extra keys sometimes, the prefix cache
on or off), ``append_tokens`` (one each or with counts, slot arrays as lists, tuples or numpy
arrays, repeats, now and then a free slot), ``schedule`` of one slot or many with a lookahead,
``reserve``, ``finish`` and ``preempt`` of several slots (a repeated slot refused) then
re-adding the returned tokens, ``reset_prefix_cache``, ``block_tables`` with and without
``out=``, calls on free slots and arguments that are no slot, over random hybrid spec mixes
(full / sliding / state groups, page sizes multiples of one base, small pools so shortfalls
happen, caching on and off, both eviction orders, KV events on).

Every request must get the lowest slot no live request holds, the same on both engines; the
model keeps each request's slot and tokens, and ``slot_of`` / ``id_of`` / ``num_tokens`` /
``preempt`` must agree with it. After every step both must agree on return values (or the
exception class and message raised), page ids and positions of every live request,
``stats()``, ``budget()`` and ``take_events()``, and both must pass ``check_invariants()``. The
events are also replayed into an index, as a router would: it must hold exactly the (group,
content hash) of every cached page, counted per page.

``HYPOTHESIS_PROFILE=ci`` runs 500 examples (about a minute on 2 cores).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from machines import RequestsMachine
from strategies import examples

EXAMPLES = examples(dev=100, ci=500, variable="REQUESTS_EXAMPLES")
STEPS = 50


RequestsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestRequestsCrossCheck = RequestsMachine.TestCase
