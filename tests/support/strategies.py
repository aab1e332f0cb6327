"""Hypothesis strategies and example counts shared by the tests (one module, so no test file
imports another and no strategy is defined twice).

- Example counts: :func:`examples` (``HYPOTHESIS_PROFILE=ci`` runs more; conftest.py registers
  the profiles).
- Ints for the native-vs-reference cross-checks (sizing and memory properties): :func:`sizes`,
  :func:`signed_sizes`, :func:`i32`, :func:`wide_sizes`, :func:`wide_signed_sizes`,
  :data:`mostly_valid`, at and far past the edges of the native types.
- Token-level caches for the state machines (requests, host tier, rows): :func:`configs` draws a
  hybrid spec mix (full, sliding, state and chunked groups) and :func:`both_caches` builds the
  native and the reference cache from it (:func:`arena_configs` / :func:`both_arena_caches`
  over an arena, :func:`arena_host_pages` for a host tier there);
  prompts are cut from :data:`DOCUMENTS`, requests are named from :data:`REQUEST_IDS`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import flat_kvcache
import flat_kvcache.reference
from hypothesis import strategies as st

# --- example counts ---------------------------------------------------------------------------

#: True under ``HYPOTHESIS_PROFILE=ci`` (what ``.ci/run`` sets).
CI_PROFILE = os.environ.get("HYPOTHESIS_PROFILE") == "ci"


def examples(*, dev: int, ci: int, variable: str | None = None) -> int:
    """How many examples a state machine runs: ``ci`` under the ci profile, else ``dev``;
    the environment ``variable``, when named and set, overrides both."""
    default = ci if CI_PROFILE else dev
    if variable is None:
        return default
    return int(os.environ.get(variable, str(default)))


# --- ints at the edges of the native types ----------------------------------------------------

U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

#: Integers at the edges of the native types, plus some far beyond them.
EDGE_INTS = [
    0,
    1,
    2,
    3,
    7,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 1,
    2**128,
    2**200,
]

#: Ints near and far beyond the ``u64`` limit.
WIDE_INTS = [2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 1, 2**100, 2**200]


@functools.cache
def sizes(*, small: int = 300) -> st.SearchStrategy[int]:
    """Non-negative ints: mostly small, some around 32 and 64 bits, some huge."""
    return st.one_of(
        st.integers(0, small),
        st.integers(0, 2**32),
        st.sampled_from(EDGE_INTS),
        st.integers(0, 2**70),
    )


@functools.cache
def signed_sizes(*, small: int = 300) -> st.SearchStrategy[int]:
    """Ints of either sign, mostly non-negative."""
    return st.one_of(sizes(small=small), sizes(small=small).map(lambda v: -v))


@functools.cache
def i32(*, low: int = I32_MIN) -> st.SearchStrategy[int]:
    """Ints that fit in 32 bits (signed), biased to the ends of the range."""
    return st.one_of(
        st.integers(max(low, -5), 64), st.integers(low, I32_MAX), st.sampled_from([low, I32_MAX])
    )


@functools.cache
def wide_sizes() -> st.SearchStrategy[int]:
    """Non-negative ints: small ones mixed with values around and far beyond ``u64``."""
    return st.one_of(sizes(), st.sampled_from(WIDE_INTS), st.integers(2**63, 2**201))


@functools.cache
def wide_signed_sizes() -> st.SearchStrategy[int]:
    """``wide_sizes`` of either sign, mostly non-negative."""
    return st.one_of(wide_sizes(), wide_sizes(), wide_sizes().map(lambda v: -v))


#: Counts and sizes of every kind: small, around and past ``u64``, now and then negative.
mostly_valid = st.one_of(sizes(), wide_sizes(), signed_sizes())


# --- token-level caches for the state machines ------------------------------------------------

#: Request ids: ints and strs (``5`` and ``"5"`` are different requests).
REQUEST_IDS = [0, 1, 2, 3, "a", "b"]
#: Documents prompts are cut from: equal prefixes of one document hash alike.
DOCUMENTS = [[1000 * d + i for i in range(96)] for d in range(3)]
#: Extra keys of a request (none, a LoRA name, a salt and a multimodal hash).
EXTRA_KEYS = [(), ("lora-1",), ("salt", "mm:7")]


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A hybrid spec mix over one base page size, a small pool and the cache options.

    ``groups`` holds ``(kind, page_size, param)``: ``param`` is the window of a sliding group,
    the chunk of a chunked one (1 to 3 pages) and None otherwise (see :func:`group_spec`).
    """
    base = draw(st.sampled_from([1, 2, 4]))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["full", "sliding_window", "state", "chunked_local"]))
        size = base * draw(st.sampled_from([1, 1, 2, 4]))
        param = None
        if kind == "sliding_window":
            param = draw(st.integers(1, 3 * size))
        elif kind == "chunked_local":
            param = size * draw(st.integers(1, 3))
        groups.append((kind, size, param))
    return {
        "groups": groups,
        "num_pages": draw(st.integers(2, 28)),
        "enable_caching": draw(st.booleans().map(lambda off: not off) | st.just(True)),
        "eviction_order": draw(st.sampled_from(["hybrid", "group"])),
        # Same-step sharing (docs/requests-api.md): schedule registers the pages it fills.
        "register_on_schedule": draw(st.booleans()),
    }


def group_spec(module: Any, kind: str, size: int, param: int | None) -> Any:
    """``module.KVCacheSpec`` of a :func:`configs` group: ``param`` is a sliding group's window
    or a chunked group's chunk."""
    if kind == "chunked_local":
        return module.KVCacheSpec(kind, size, None, None, param)
    return module.KVCacheSpec(kind, size, param)


def both_caches(config: dict[str, Any], **options: Any) -> list[Any]:
    """The native cache and the reference one for a :func:`configs` draw (``options``: more
    constructor keywords), native first."""
    caches = []
    for module in (flat_kvcache, flat_kvcache.reference):
        specs = [group_spec(module, *group) for group in config["groups"]]
        caches.append(
            module.FlatKVCache(
                specs,
                config["num_pages"],
                enable_caching=config["enable_caching"],
                eviction_order=config["eviction_order"],
                register_on_schedule=config["register_on_schedule"],
                **options,
            )
        )
    return caches


@st.composite
def arena_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A :func:`configs` draw laid out in an arena (SPEC 13 storage, ``FlatKVCache(arena=)``):
    at most one state group, ``unit_bytes`` 6 to 48, each page group's page a share of the unit
    (sometimes a byte less, so pages straddle units and units hold ``per_unit`` or
    ``per_unit - 1`` pages), ``num_units`` 2 to 12. An arena plan has one page size in tokens
    for every page group (``ArenaPlan.page_size``, which the engine checks), so the page groups
    take one of the drawn sizes (a chunk keeps its count of pages), and the state group a grain
    of 1, 2 or 4 such pages. ``num_pages`` is unused."""
    config = draw(configs())
    paged = sorted({size for kind, size, _ in config["groups"] if kind != "state"})
    tokens = draw(st.sampled_from(paged)) if paged else config["groups"][0][1]
    groups: list[tuple[str, int, Any]] = []
    for kind, size, param in config["groups"]:
        if kind == "state" and any(g[0] == "state" for g in groups):
            kind, param = "full", None
        if kind == "state":
            groups.append((kind, tokens * draw(st.sampled_from([1, 2, 4])), param))
        elif kind == "chunked_local":
            groups.append((kind, tokens, tokens * (param // size)))
        else:
            groups.append((kind, tokens, param))
    unit = draw(st.integers(6, 48))
    page_bytes = []
    for kind, _, _ in groups:
        if kind == "state":
            page_bytes.append(unit)
            continue
        share = draw(st.integers(1, 4))
        page = unit // share
        if share >= 2 and draw(st.booleans()):
            page -= 1  # straddling pages: still at least one page per unit
        page_bytes.append(max(page, 1))
    return {
        **config,
        "groups": groups,
        "unit_bytes": unit,
        "num_units": draw(st.integers(2, 12)),
        "page_bytes": page_bytes,
    }


def arena_plan(config: dict[str, Any]) -> Any:
    """The ``ArenaPlan`` of an :func:`arena_configs` draw (groups named ``g0``, ``g1``, ...)."""
    unit, units = config["unit_bytes"], config["num_units"]
    groups = tuple(
        flat_kvcache.ArenaGroup(
            group_id=f"g{i}",
            kind="state" if kind == "state" else "pages",
            item_bytes=page,
            per_unit=unit // page,
            num_ids=units * unit // page,
            slack_bytes=unit - (unit // page) * page,
        )
        for i, ((kind, _, _), page) in enumerate(zip(config["groups"], config["page_bytes"], strict=True))
    )
    tokens = next((size for kind, size, _ in config["groups"] if kind != "state"), 1)
    return flat_kvcache.ArenaPlan(
        page_size=tokens, alignment=1, unit_bytes=unit, num_units=units, groups=groups, components=()
    )


def both_arena_caches(config: dict[str, Any], **options: Any) -> list[Any]:
    """The native and the reference cache of an :func:`arena_configs` draw, native first."""
    return both_caches({**config, "num_pages": None}, arena=arena_plan(config), **options)


@st.composite
def arena_host_pages(draw: st.DrawFn) -> int | dict[str, int]:
    """The ``host_pages`` of a host tier over an :func:`arena_configs` cache: mostly an int
    (every group's host pages, 1 to 12), else a mapping naming some of ``g0`` to ``g2`` (0 to 12 each; the
    caller keeps the cache's own groups, the others are untiered)."""
    if draw(st.integers(0, 2)):
        return draw(st.integers(1, 12))
    named = draw(st.lists(st.sampled_from(["g0", "g1", "g2"]), unique=True, max_size=3))
    return {gid: draw(st.integers(0, 12)) for gid in named}
