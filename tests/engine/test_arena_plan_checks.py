"""A plan from ``plan_arena`` is one ``FlatKVCache(arena=)`` can use, and ``FlatKVCache(arena=)``
reads the plan it is given against its specs (docs/sizing-api.md "Arena plan", docs/engine-api.md
"Arena"), on both engines.

- Every plan the planner returns builds a cache: the engine refuses an arena some unit of which
  holds no whole page of some group (pages lie at multiples of their bytes; one across two units
  is never handed out), so the planner must never return one. Checked on the shapes that once
  slipped through (3-byte pages beside a 4-byte slot; 40 KiB pages beside a 48 KiB slot) and on
  random shapes, with the unit's pages counted from the contract's formula, not the engine.
- The planner's own arguments come in the documented order: its ints first, then each
  component a ``ComponentSpec`` whose ``group_id`` and ``component`` are str, then their numbers.
- ``arena=`` is checked field by field (``TypeError`` naming the field), then in itself (no group
  twice, every component in one of its groups), then against the specs (the same groups, each
  laid out as its kind, every page group's pages of ``arena.page_size`` tokens).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference
import pytest
from flat_kvcache._types import ArenaComponent, ArenaPlan, ComponentSpec
from flat_kvcache.presets import get_preset
from helpers import need
from hypothesis import given
from hypothesis import strategies as st

BOTH = [pytest.param(flat_kvcache, id="native"), pytest.param(flat_kvcache.reference, id="reference")]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pages_in_unit(unit_bytes: int, page_bytes: int, unit: int) -> int:
    """Whole pages of ``page_bytes`` inside ``unit`` (the contract: ``ceil(u U / s) ..
    floor((u + 1) U / s) - 1``)."""
    return (unit + 1) * unit_bytes // page_bytes - ceil_div(unit * unit_bytes, page_bytes)


def specs_for(api: ModuleType, plan: ArenaPlan, grain: int | None = None) -> list[Any]:
    """The cache's specs for ``plan``'s groups: full attention over each page group, a state
    group of ``grain`` tokens (the page size by default) over the state group."""
    specs = []
    for group in plan.groups:
        if group.kind == "pages":
            specs.append(api.KVCacheSpec("full", plan.page_size, group_id=group.group_id))
        else:
            specs.append(api.KVCacheSpec("state", grain or plan.page_size, group_id=group.group_id))
    return specs


def usable(api: ModuleType, plan: ArenaPlan) -> Any:
    """The cache over ``plan``, after checking by the contract's formula that every unit but the
    null one holds a page of every page group (over one whole period of the units' offsets)."""
    for group in plan.groups:
        if group.kind != "pages":
            continue
        period = group.item_bytes // math.gcd(plan.unit_bytes, group.item_bytes)
        for unit in range(1, min(plan.num_units, period + 1)):
            assert pages_in_unit(plan.unit_bytes, group.item_bytes, unit) >= 1, (unit, group, plan)
    return api.FlatKVCache(specs_for(api, plan), arena=plan)


# --- every plan is usable ----------------------------------------------------------------------


@pytest.mark.parametrize("api", BOTH)
def test_three_byte_pages_beside_a_four_byte_slot(api: ModuleType) -> None:
    """The issue's reproduction: a unit of 4 (the slot) would leave bytes 4..8 without a whole
    3-byte page; 2 * 3 - 3 / 3 = 5 holds one in every unit."""
    comps = [ComponentSpec("attn", 0, "kv", 3, 0), ComponentSpec("ssm", 1, "state", 0, 4)]
    plan = api.plan_arena(comps, 1, 12, alignment=1)
    assert (plan.unit_bytes, plan.num_units) == (5, 2)
    usable(api, plan)
    # Three usable units: a request's page and its state slot fit.
    cache = usable(api, api.plan_arena(comps, 1, 20, alignment=1))
    slot, _ = cache.add_request("a", [1, 2, 3])
    assert cache.schedule([slot], [1]).tolist() == [True]


@pytest.mark.parametrize("api", BOTH)
def test_forty_kib_pages_beside_a_forty_eight_kib_slot(api: ModuleType) -> None:
    """A realistic shape: 16-token pages of 2,560 bytes a token (40 KiB) and a 48 KiB state slot,
    alignment 256. A 48 KiB unit holds no page where it starts 8 KiB into one; 2 * 40 - 40 / 2 =
    60 KiB (a multiple of 256, gcd 20 KiB) holds one everywhere."""
    comps = [ComponentSpec("attn", 0, "kv", 2560, 0), ComponentSpec("ssm", 1, "state", 0, 48 << 10)]
    plan = api.plan_arena(comps, 16, 64 << 20)
    assert plan.unit_bytes == 60 << 10
    usable(api, plan)


PAGE_GROUPS = st.lists(st.integers(1, 700), min_size=1, max_size=3)


@pytest.mark.properties
@pytest.mark.parametrize("api", BOTH)
@given(
    per_token=PAGE_GROUPS,
    state=st.one_of(st.none(), st.integers(1, 5000)),
    page_size=st.integers(1, 16),
    alignment=st.sampled_from([1, 2, 8, 64, 256]),
    units=st.integers(2, 40),
)
def test_every_plan_builds_a_cache(
    api: ModuleType, per_token: list[int], state: int | None, page_size: int, alignment: int, units: int
) -> None:
    comps = [ComponentSpec(f"p{i}", i, "kv", b, 0) for i, b in enumerate(per_token)]
    if state is not None:
        comps.append(ComponentSpec("s", len(comps), "state", 0, state))
    unit = api.plan_arena(comps, page_size, 2**60, alignment=alignment).unit_bytes
    plan = api.plan_arena(comps, page_size, units * unit, alignment=alignment)
    assert plan.num_units == units
    # The unit is never below the default rule's (docs/sizing-api.md) nor past 2 b - 1 rounded up.
    largest = max(per_token) * page_size
    assert plan.unit_bytes <= ceil_div(max(2 * largest - 1, plan.unit_bytes), alignment) * alignment
    usable(api, plan)


# --- plan_arena's argument order ----------------------------------------------------------------


@pytest.mark.parametrize("api", BOTH)
def test_plan_arena_checks_its_ints_before_the_components(api: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"^page_size must be > 0, got 0$"):
        api.plan_arena(5, 0, 100)
    with pytest.raises(ValueError, match=r"^budget_bytes must be >= 0, got -1$"):
        api.plan_arena([5], 16, -1)


@pytest.mark.parametrize("api", BOTH)
def test_plan_arena_components_must_be_component_specs(api: ModuleType) -> None:
    good = ComponentSpec("full", 0, "kv", 8, 0)
    with pytest.raises(TypeError, match=r"^components must be a sequence of ComponentSpec, got int$"):
        api.plan_arena(5, 16, 1 << 20)
    with pytest.raises(TypeError, match=r"^components\[1\] must be a ComponentSpec, got int$"):
        api.plan_arena([good, 5], 16, 1 << 20)
    # Every item is one before any item's numbers are read: item 0's bad size comes second.
    with pytest.raises(TypeError, match=r"^components\[1\] must be a ComponentSpec, got tuple$"):
        api.plan_arena([replace(good, bytes_per_slot=-1), ("full", 0, "kv", 8, 0)], 16, 1 << 20)
    with pytest.raises(TypeError, match=r"^components\[0\]\.group_id must be a str, got int$"):
        api.plan_arena([replace(good, group_id=5)], 16, 1 << 20)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^components\[0\]\.component must be a str, got NoneType$"):
        api.plan_arena([replace(good, component=None)], 16, 1 << 20)  # type: ignore[arg-type]
    with pytest.raises(UnicodeEncodeError):
        api.plan_arena([replace(good, group_id="\ud800")], 16, 1 << 20)


def test_plan_arena_errors_are_the_same_on_both() -> None:
    good = ComponentSpec("full", 0, "kv", 8, 0)
    cases: list[tuple[Any, ...]] = [
        (5, 0, 100),
        ([5], 0, 100),
        ([5], 16, 100),
        ("ab", 16, 100),
        ([good, replace(good, group_id=7)], 16, 1 << 20),  # type: ignore[arg-type]
        ([replace(good, layer="x"), 5], 16, 1 << 20),  # type: ignore[arg-type]
        ([replace(good, group_id="\ud800")], 16, 1 << 20),
    ]
    for args in cases:
        messages = []
        for api in (flat_kvcache, flat_kvcache.reference):
            with pytest.raises(Exception) as caught:
                api.plan_arena(*args)
            messages.append((type(caught.value), str(caught.value)))
        assert messages[0] == messages[1], args


# --- arena= is read against the specs -----------------------------------------------------------


def small_plan(api: ModuleType, page_size: int = 4) -> ArenaPlan:
    comps = [ComponentSpec("full", 0, "kv", 8, 0), ComponentSpec("s", 1, "state", 0, 100)]
    plan: ArenaPlan = api.plan_arena(comps, page_size, 1 << 16, alignment=32)
    return plan


def refused(api: ModuleType, plan: Any, specs: list[Any] | None = None) -> tuple[type, str]:
    good = small_plan(api)
    with pytest.raises(Exception) as caught:
        api.FlatKVCache(specs_for(api, good) if specs is None else specs, arena=plan)
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("change", "kind", "message"),
    [
        ({"page_size": None}, TypeError, "arena.page_size must be an int, got NoneType"),
        ({"alignment": "8"}, TypeError, "arena.alignment must be an int, got str"),
        ({"groups": [5]}, TypeError, "arena.groups[0] must be an ArenaGroup, got int"),
        ({"groups": 5}, TypeError, "arena.groups must be a sequence of ArenaGroup, got int"),
        ({"components": 5}, TypeError, "arena.components must be a sequence of ArenaComponent, got int"),
        (
            {"components": [("full", 0, "kv", 0, 32)]},
            TypeError,
            "arena.components[0] must be an ArenaComponent",
        ),
    ],
)
@pytest.mark.parametrize("api", BOTH)
def test_a_plan_field_of_the_wrong_type_is_named(
    api: ModuleType, change: dict[str, Any], kind: type, message: str
) -> None:
    got = refused(api, replace(small_plan(api), **change))
    assert got[0] is kind and got[1].startswith(message), got


@pytest.mark.parametrize("api", BOTH)
def test_a_plan_that_lists_a_group_twice_is_refused(api: ModuleType) -> None:
    plan = small_plan(api)
    twice = replace(plan, groups=(*plan.groups, plan.groups[0]))
    assert refused(api, twice) == (ValueError, 'arena: the plan lists group "full" twice')


@pytest.mark.parametrize("api", BOTH)
def test_a_component_outside_the_plans_groups_is_refused(api: ModuleType) -> None:
    plan = small_plan(api)
    stray = replace(plan, components=(*plan.components, ArenaComponent("x", 2, "kv", 0, 1)))
    assert refused(api, stray) == (
        ValueError,
        'arena: arena.components[2] lies in group "x", which the plan does not list',
    )


@pytest.mark.parametrize("api", BOTH)
def test_pages_of_another_size_than_the_plans_are_refused(api: ModuleType) -> None:
    plan = small_plan(api, page_size=4)
    specs = [api.KVCacheSpec("full", 8, group_id="full"), api.KVCacheSpec("state", 8, group_id="s")]
    assert refused(api, plan, specs) == (
        ValueError,
        'arena: group "full" has pages of 8 tokens but the plan\'s pages hold 4 (arena.page_size)',
    )
    # The plan's own pages build (the state group's grain may be any multiple of the page).
    specs[0] = api.KVCacheSpec("full", 4, group_id="full")
    assert api.FlatKVCache(specs, arena=plan).group_ids == ["full", "s"]


@pytest.mark.torch
def test_cache_from_config_refuses_an_arena_planned_for_another_page_size() -> None:
    """``cache_from_config(model, arena=plan, page_size=7)`` with a plan of 16-token pages: the
    groups get 7-token pages, the plan's hold 16, and the engine says so."""
    need("torch")
    from flat_kvcache.torch import ModelShape

    shape = ModelShape.from_config(get_preset("qwen3.5-like"))
    plan = flat_kvcache.plan_arena(shape.components(), 16, 8 << 30)
    with pytest.raises(ValueError, match=r"has pages of 7 tokens but the plan's pages hold 16"):
        flat_kvcache.cache_from_config("qwen3.5-like", arena=plan, page_size=7)
    built = flat_kvcache.cache_from_config("qwen3.5-like", arena=plan, page_size=16)
    assert built.arena_stats() is not None


# --- what docs/engine-api.md says of both engines ----------------------------------------------


@pytest.mark.parametrize("api", BOTH)
def test_a_state_group_is_sparse_over_equal_pages_too(api: ModuleType) -> None:
    """SPEC 13.4 in a plain ``num_pages`` cache: an acquire puts a page only in the last slot it
    adds (not one per slot, as section 6's allocation would), and the working page moves to
    the new last slot rather than a second page being taken."""
    cache = api.PageCache([api.KVCacheSpec("state", 4)], 32)
    assert cache.pages_needed(16) == 1
    assert cache.acquire("a", 16)
    (table,) = cache.page_ids("a")
    assert list(table[:3]) == [0, 0, 0] and table[3] != 0
    page = table[3]
    assert cache.acquire("a", 3)
    assert [list(t) for t in cache.page_ids("a")] == [[0, 0, 0, 0, page]]
    assert cache.stats()["pages_in_use"] == 1  # one working page, not one per slot


def test_only_the_native_classes_share_a_base() -> None:
    """docs/engine-api.md: the native classes derive from ``_PagedCacheBase``; the reference
    composes each of mixins and has no such base."""
    native = flat_kvcache._native._PagedCacheBase
    assert issubclass(flat_kvcache.PageCache, native) and issubclass(flat_kvcache.FlatKVCache, native)
    assert not hasattr(flat_kvcache.reference, "_PagedCacheBase")
    shared = set(flat_kvcache.reference.PageCache.__mro__) & set(flat_kvcache.reference.FlatKVCache.__mro__)
    assert all(cls is object or cls.__module__.startswith("flat_kvcache.reference") for cls in shared)
