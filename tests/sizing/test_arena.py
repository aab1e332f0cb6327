"""The SPEC 13 arena plan, ``plan_arena`` (docs/sizing-api.md "Arena plan"), on both implementations.

The worked examples and the error cases run against native and reference (``api`` fixture);
expected numbers are worked out by hand from the contract, with the working in comments. The
layout properties (every component inside its item, aligned state offsets, contiguous pages,
the page ids of a unit) are checked on every plan. The hypothesis tests then cross-check native
against the reference on random inputs, far past ``u64``: the same result, or the same exception
class and message; native raises ``OverflowError`` (naming an argument) exactly when a size of
the reference's result does not fit ``u64``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import flat_kvcache
import flat_kvcache.reference as reference
import numpy as np
import pytest
from flat_kvcache._types import ArenaComponent, ArenaGroup, ArenaPlan, ComponentSpec
from flat_kvcache.errors import ConfigError
from helpers import Outcome, outcome
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import U64_MAX, i32, mostly_valid, sizes, wide_sizes

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"

NEED_TWO = "budget_bytes={} gives {} units of {} bytes; need at least 2 (unit 0 is null)"
MIXES = "group {} mixes per-token and constant components"
NO_BYTES = "group {} holds no bytes"
EMPTY = "components must not be empty"

#: What a native OverflowError may name.
ARGUMENTS = ["page_size", "budget_bytes", "alignment", "components", "bytes_per_slot", "const_bytes"]

#: Both implementations, for the hypothesis tests (a function-scoped fixture does not mix with @given).
BOTH = [pytest.param(flat_kvcache, id="native"), pytest.param(reference, id="reference")]


def kv(group: str, layer: int, bytes_per_slot: int, name: str = "kv") -> ComponentSpec:
    return ComponentSpec(group, layer, name, bytes_per_slot, 0)


def const(group: str, layer: int, name: str, nbytes: int) -> ComponentSpec:
    return ComponentSpec(group, layer, name, 0, nbytes)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- the layout properties every plan has ------------------------------------------------------


def unit_page_ids(plan: ArenaPlan, group: ArenaGroup, unit: int) -> range:
    """The contract's page ids of ``unit``: ``ceil(u*U/s) .. floor((u+1)*U/s) - 1``."""
    unit_bytes, page = plan.unit_bytes, group.item_bytes
    return range(ceil_div(unit * unit_bytes, page), (unit + 1) * unit_bytes // page)


def check_page_ids(plan: ArenaPlan, group: ArenaGroup) -> None:
    """The page ids of the units of a page group, unit by unit.

    With ``U = q*s + r`` (``q = per_unit``, ``r = slack_bytes``), unit ``u`` starts ``d = (-u*U)
    mod s`` bytes before its first whole page, so it holds ``floor((U - d) / s)`` pages: ``q``
    when ``d <= r``, else ``q - 1`` (never ``q + 1``: ``U - d <= U < (q + 1) * s``). Without
    slack every ``d`` is 0 and every unit holds exactly ``q``. Unit 0 always holds ``q``. The
    ranges follow each other with a gap of at most one page (the one straddling the boundary)
    and end at ``num_ids``. Checked on the first and last 32 units (an arena may have 2**64).
    """
    unit_bytes, page, per_unit = plan.unit_bytes, group.item_bytes, group.per_unit
    units = sorted({*range(min(plan.num_units, 32)), *range(max(plan.num_units - 32, 0), plan.num_units)})
    previous: tuple[int, int] = (-1, 0)  # the unit checked last and the end of its ids
    for unit in units:
        ids = unit_page_ids(plan, group, unit)
        count = ids.stop - ids.start  # len() of a range past sys.maxsize raises
        allowed = {per_unit} if group.slack_bytes == 0 or unit == 0 else {per_unit - 1, per_unit}
        assert count in allowed, (unit, ids, group)
        assert count >= 1, f"unit {unit} holds no page of {group}: FlatKVCache(arena=) would refuse it"
        assert ids.start * page >= unit * unit_bytes  # no page starts in the unit before
        assert ids.stop * page <= (unit + 1) * unit_bytes  # nor ends in the unit after
        if previous[0] == unit - 1:
            straddles = ids.start - previous[1]  # the page across the boundary, never handed out
            assert straddles in {0, 1}, (unit, ids, group)
            if straddles:
                assert (ids.start - 1) * page < unit * unit_bytes < ids.start * page
        previous = (unit, ids.stop)
    assert previous[1] == group.num_ids


def check_layout(plan: ArenaPlan, comps: Sequence[ComponentSpec], budget: int) -> None:
    """Every layout property of the contract that holds whatever the numbers."""
    groups = {group.group_id: group for group in plan.groups}
    assert list(groups) == list(dict.fromkeys(comp.group_id for comp in comps))  # first appearance
    assert len(plan.components) == len(comps)
    assert plan.num_units >= 2
    assert plan.num_units * plan.unit_bytes <= budget < (plan.num_units + 1) * plan.unit_bytes
    has_state = any(group.kind == "state" for group in plan.groups)
    if has_state:
        assert plan.unit_bytes % plan.alignment == 0
    for group in plan.groups:
        assert group.kind in {"pages", "state"}
        assert group.per_unit * group.item_bytes + group.slack_bytes == plan.unit_bytes
        assert group.per_unit >= 1 and group.slack_bytes >= 0
        if group.kind == "pages":
            assert group.slack_bytes < group.item_bytes
            assert group.num_ids == plan.num_units * plan.unit_bytes // group.item_bytes
            check_page_ids(plan, group)
        else:
            assert group.per_unit == 1 and group.num_ids == plan.num_units
            assert group.item_bytes % plan.alignment == 0
    page_ends = {group.group_id: 0 for group in plan.groups if group.kind == "pages"}
    slot_end = 0
    for comp, placed in zip(comps, plan.components, strict=True):
        assert (placed.group_id, placed.layer, placed.component) == (
            comp.group_id,
            comp.layer,
            comp.component,
        )
        group = groups[comp.group_id]
        assert placed.offset + placed.nbytes <= group.item_bytes  # inside its item
        if group.kind == "pages":  # side by side, in order, from offset 0
            assert placed.nbytes == comp.bytes_per_slot * plan.page_size
            assert placed.offset == page_ends[comp.group_id]
            page_ends[comp.group_id] += placed.nbytes
        else:  # aligned, in order, each after the one before
            assert placed.nbytes == comp.const_bytes
            assert placed.offset % plan.alignment == 0
            assert slot_end <= placed.offset < slot_end + plan.alignment
            slot_end = placed.offset + placed.nbytes
    for group_id, end in page_ends.items():
        assert end == groups[group_id].item_bytes  # the components fill the page exactly


def plan(
    api: ModuleType, comps: Sequence[ComponentSpec], page_size: int, budget: int, **kw: Any
) -> ArenaPlan:
    """``api.plan_arena`` with the layout properties checked."""
    result: ArenaPlan = api.plan_arena(comps, page_size, budget, **kw)
    check_layout(result, comps, budget)
    return result


# --- names ---------------------------------------------------------------------------------------


def test_both_implementations_export_plan_arena(api: ModuleType) -> None:
    assert "plan_arena" in api.memory.__all__ and "plan_arena" in api.__all__
    assert api.plan_arena is api.memory.plan_arena


def test_both_implementations_export_the_same_arena_names() -> None:
    def arena_names(module: ModuleType) -> set[str]:
        return {name for name in module.__all__ if "arena" in name.lower()}

    assert arena_names(flat_kvcache) == arena_names(reference)
    assert arena_names(flat_kvcache.memory) == arena_names(reference.memory)


# --- worked examples -----------------------------------------------------------------------------


def qwen35_like() -> list[ComponentSpec]:
    """32 layers, every 4th full attention (8 layers, 4096 bytes per token) and the other 24
    linear attention, each with a conv state of 49152 bytes and an ssm state of 2097152 bytes."""
    comps = []
    for layer in range(32):
        if layer % 4 == 3:
            comps.append(kv(FULL, layer, 4096))
        else:
            comps += [const(LINEAR, layer, "conv", 49152), const(LINEAR, layer, "ssm", 2097152)]
    return comps


def test_qwen35_like_mix(api: ModuleType) -> None:
    # page: 16 tokens * 8 layers * 4096 = 524288 bytes; a full layer's kv is 16 * 4096 = 65536.
    # slot (alignment 256): conv 49152 = 192*256 and ssm 2097152 = 8192*256 are aligned already,
    # so a linear layer takes 49152 + 2097152 = 2146304 bytes and 24 of them 51511296.
    # unit = round_up(max(51511296, 524288), 256) = 51511296; 51511296 // 524288 = 98 pages
    # (98 * 524288 = 51380224), slack 131072 (a quarter page: U/s = 98.25).
    # budget 10 units + 12345: num_units 10; page ids 10 * 51511296 // 524288 = 982 (982.5).
    comps = qwen35_like()
    result = plan(api, comps, 16, 10 * 51511296 + 12345)
    assert (result.page_size, result.alignment, result.unit_bytes, result.num_units) == (
        16,
        256,
        51511296,
        10,
    )
    # groups in first-appearance order: layer 0 is linear attention
    assert result.groups == (
        ArenaGroup(LINEAR, "state", 51511296, 1, 10, 0),
        ArenaGroup(FULL, "pages", 524288, 98, 982, 131072),
    )
    linear_index = full_index = 0
    for comp, placed in zip(comps, result.components, strict=True):
        if comp.group_id == FULL:  # the j-th full layer at j * 65536
            assert placed == ArenaComponent(FULL, comp.layer, "kv", full_index * 65536, 65536)
            full_index += 1
        elif comp.component == "conv":  # the m-th linear layer at m * 2146304
            assert placed == ArenaComponent(LINEAR, comp.layer, "conv", linear_index * 2146304, 49152)
        else:
            assert placed == ArenaComponent(
                LINEAR, comp.layer, "ssm", linear_index * 2146304 + 49152, 2097152
            )
            linear_index += 1
    # U/s = 393/4: unit 0 holds pages 0..97 (98), unit 1 pages ceil(98.25)=99 .. floor(196.5)-1 = 195
    # (97: page 98 straddles), unit 3 pages ceil(294.75)=295 .. 392 (98: 4U = 393 pages exactly)
    full = result.groups[1]
    assert unit_page_ids(result, full, 0) == range(0, 98)
    assert unit_page_ids(result, full, 1) == range(99, 196)
    assert unit_page_ids(result, full, 2) == range(197, 294)
    assert unit_page_ids(result, full, 3) == range(295, 393)
    assert unit_page_ids(result, full, 4) == range(393, 491)
    assert unit_page_ids(result, full, 9) == range(885, 982)  # ceil(884.25) .. floor(982.5) - 1


def test_gemma3_like_two_page_groups_within_four_pages(api: ModuleType) -> None:
    # sliding: 3 layers * 512 bytes/token * 16 = 24576 bytes a page; full: 2 layers -> 16384.
    # lcm(3 * 2**13, 2**14) = 3 * 2**14 = 49152 <= 4 * 24576 = 98304: unit 49152, no slack
    # (3 full pages, 2 sliding pages); no state group, so nothing is rounded to the alignment.
    # budget 7 units: num_ids 7 * 49152 // 16384 = 21 (full), // 24576 = 14 (sliding).
    comps = [
        kv(SLIDING, 0, 512),
        kv(SLIDING, 1, 512),
        kv(FULL, 2, 512),
        kv(SLIDING, 3, 512),
        kv(FULL, 4, 512),
    ]
    result = plan(api, comps, 16, 7 * 49152)
    assert result == ArenaPlan(
        page_size=16,
        alignment=256,
        unit_bytes=49152,
        num_units=7,
        groups=(ArenaGroup(SLIDING, "pages", 24576, 2, 14, 0), ArenaGroup(FULL, "pages", 16384, 3, 21, 0)),
        components=(
            ArenaComponent(SLIDING, 0, "kv", 0, 8192),
            ArenaComponent(SLIDING, 1, "kv", 8192, 8192),
            ArenaComponent(FULL, 2, "kv", 0, 8192),
            ArenaComponent(SLIDING, 3, "kv", 16384, 8192),
            ArenaComponent(FULL, 4, "kv", 8192, 8192),
        ),
    )
    # zero slack: unit u holds pages u*q .. (u+1)*q - 1 exactly
    assert unit_page_ids(result, result.groups[1], 5) == range(15, 18)


def test_gemma3_like_two_page_groups_beyond_four_pages(api: ModuleType) -> None:
    # full: 5 layers * 1024 * 16 = 81920 = 5 * 2**14; sliding: 7 layers -> 114688 = 7 * 2**14.
    # lcm = 35 * 2**14 = 573440 > 4 * 114688 = 458752: the unit would be the largest page,
    # 114688, but gcd(114688, 81920) = 16384 and 114688 + 16384 < 2 * 81920: unit 1 (bytes
    # 114688..229376) holds no full page (81920..163840 and 163840..245760 straddle). Below
    # 2 * 114688 - 1 only 2 * 114688 - 114688 / k (k | 114688) holds a sliding page in every
    # unit: k = 1 is 114688 (no), k = 2 is 172032 = 21 * 8192, and gcd(172032, 81920) = 8192:
    # 172032 + 8192 >= 163840, a full page in every unit. Budget 4 units + 1: 4 units.
    # sliding: 1 page a unit (1.5 of bytes), slack 57344, ids 688128 // 114688 = 6;
    # full: 2 pages a unit at most (2.1), slack 8192, ids 688128 // 81920 = 8 (8.4).
    comps = [kv(SLIDING, layer, 1024) for layer in range(7)] + [kv(FULL, 7 + i, 1024) for i in range(5)]
    result = plan(api, comps, 16, 4 * 172032 + 1)
    assert (result.unit_bytes, result.num_units) == (172032, 4)
    assert result.groups == (
        ArenaGroup(SLIDING, "pages", 114688, 1, 6, 57344),
        ArenaGroup(FULL, "pages", 81920, 2, 8, 8192),
    )
    # full, U/s = 2.1: unit 0 pages 0, 1; unit 1 ceil(2.1) = 3 .. floor(4.2) - 1 = 3; unit 2
    # 5 .. 5; unit 3 7 .. 7 (pages 2, 4, 6 straddle). Sliding, U/s = 1.5: 0; 2; 3; 5.
    full, sliding = result.groups[1], result.groups[0]
    assert [unit_page_ids(result, full, u) for u in range(4)] == [
        range(0, 2),
        range(3, 4),
        range(5, 6),
        range(7, 8),
    ]
    assert [unit_page_ids(result, sliding, u) for u in range(4)] == [
        range(0, 1),
        range(2, 3),
        range(3, 4),
        range(5, 6),
    ]


@pytest.mark.parametrize(
    ("per_token", "unit_bytes", "per_unit"),
    [
        ((4, 5), 20, (5, 4)),  # lcm 20 = 4 * 5: the bound is inclusive, unit 20 (not a multiple of 256)
        # lcm 30 > 4 * 6 = 24: the largest page, 6, but 6 + gcd(6, 5) < 2 * 5 (unit 1, bytes
        # 6..12, holds no 5-byte page); 12 - 6 / k for k | 6: 9 (k = 2): 9 + 1 >= 10 and
        # 12 - 9 = 3 divides 6, so every unit holds a page of both.
        ((5, 6), 9, (1, 1)),
        ((2, 3, 4), 12, (6, 4, 3)),  # lcm 12 <= 16
        # lcm 60 > 20: the largest page, 5; 5 + gcd(5, 4) < 8: 10 - 5 / k for k | 5: 5 (k = 1,
        # no) or 9 (k = 5): 9 + gcd(9, 3) >= 6, 9 + 1 >= 8, 10 - 9 = 1 divides 5.
        ((3, 4, 5), 9, (3, 2, 1)),
        ((6, 6), 6, (1, 1)),  # equal pages
    ],
)
def test_unit_of_page_groups_only(
    api: ModuleType, per_token: tuple[int, ...], unit_bytes: int, per_unit: tuple[int, ...]
) -> None:
    comps = [kv(f"g{i}", i, b) for i, b in enumerate(per_token)]  # page_size 1: a page is b bytes
    result = plan(api, comps, 1, 3 * unit_bytes)
    assert (result.unit_bytes, result.num_units) == (unit_bytes, 3)
    assert tuple(g.per_unit for g in result.groups) == per_unit
    assert tuple(g.slack_bytes for g in result.groups) == tuple(
        unit_bytes - q * b for q, b in zip(per_unit, per_token, strict=True)
    )


def test_one_page_group(api: ModuleType) -> None:
    # page 3 * 100 = 300 = the unit (lcm of one page); 900 // 300 = 3 units, 3 ids
    result = plan(api, [kv(FULL, 0, 100)], 3, 900)
    assert result == ArenaPlan(
        3, 256, 300, 3, (ArenaGroup(FULL, "pages", 300, 1, 3, 0),), (ArenaComponent(FULL, 0, "kv", 0, 300),)
    )


def test_one_state_group(api: ModuleType) -> None:
    # slot: 1000 rounded up to 256 = 1024 = the unit; 2048 // 1024 = 2 units
    result = plan(api, [const(LINEAR, 0, "ssm", 1000)], 16, 2048)
    assert result == ArenaPlan(
        16,
        256,
        1024,
        2,
        (ArenaGroup(LINEAR, "state", 1024, 1, 2, 0),),
        (ArenaComponent(LINEAR, 0, "ssm", 0, 1000),),
    )


def test_a_budget_without_a_working_slot_per_live_request_is_a_config_error(api: ModuleType) -> None:
    # slot 1024 = the unit; 5 * 1024 bytes = 5 units: 4 working state slots (unit 0 is null).
    comps = [kv(FULL, 0, 10), const(LINEAR, 1, "ssm", 1000)]
    for live in (0, 1, 4):
        assert api.plan_arena(comps, 16, 5 * 1024, max_live_requests=live).num_units == 5
    with pytest.raises(ConfigError) as err:
        api.plan_arena(comps, 16, 5 * 1024 + 1023, max_live_requests=5)
    assert str(err.value) == (
        "budget_bytes=6143 gives 5 units of 1024 bytes: 4 working state slots, fewer than "
        "max_live_requests=5 live requests need (one each); give budget_bytes >= 6144 or fewer "
        "live requests"
    )
    with pytest.raises(ConfigError, match=r"max_live_requests=1180591620717411303424 live"):
        api.plan_arena(comps, 16, 5 * 1024, max_live_requests=2**70)
    # Without state groups nothing holds a working slot: any count passes.
    assert api.plan_arena([kv(FULL, 0, 10)], 16, 5 * 160, max_live_requests=10**6).num_units == 5
    with pytest.raises(ValueError, match=r"^max_live_requests must be >= 0, got -1$"):
        api.plan_arena(comps, 16, 5 * 1024, max_live_requests=-1)
    with pytest.raises(TypeError, match="max_live_requests"):
        api.plan_arena(comps, 16, 5 * 1024, max_live_requests="4")


def test_state_slot_offsets_are_aligned(api: ModuleType) -> None:
    # alignment 64. slot: s.a at 0 (100), page kv between, s.b at round_up(100) = 128 (300, end 428),
    # t.c at round_up(428) = 448 (5, end 453); slot = round_up(453) = 512.
    # page: 4 tokens * 8 = 32. unit = round_up(max(512, 32), 64) = 512: 16 pages, no slack.
    # budget 2000: 3 units (1536); page ids 1536 // 32 = 48; each state group: 3 slots, slack 0.
    comps = [const("s", 0, "a", 100), kv("g", 1, 8), const("s", 2, "b", 300), const("t", 3, "c", 5)]
    result = plan(api, comps, 4, 2000, alignment=64)
    assert result == ArenaPlan(
        page_size=4,
        alignment=64,
        unit_bytes=512,
        num_units=3,
        groups=(
            ArenaGroup("s", "state", 512, 1, 3, 0),
            ArenaGroup("g", "pages", 32, 16, 48, 0),
            ArenaGroup("t", "state", 512, 1, 3, 0),
        ),
        components=(
            ArenaComponent("s", 0, "a", 0, 100),
            ArenaComponent("g", 1, "kv", 0, 32),
            ArenaComponent("s", 2, "b", 128, 300),
            ArenaComponent("t", 3, "c", 448, 5),
        ),
    )


def test_page_larger_than_the_state_slot(api: ModuleType) -> None:
    # page 16 * 4096 = 65536 > slot round_up(1000, 256) = 1024: unit 65536 (aligned already);
    # the state group leaves 65536 - 1024 = 64512 bytes of a unit unused
    result = plan(api, [kv(FULL, 0, 4096), const(LINEAR, 1, "conv", 1000)], 16, 65536 * 2)
    assert (result.unit_bytes, result.num_units) == (65536, 2)
    assert result.groups == (
        ArenaGroup(FULL, "pages", 65536, 1, 2, 0),
        ArenaGroup(LINEAR, "state", 1024, 1, 2, 64512),
    )


def test_unaligned_page_with_state_rounds_the_unit(api: ModuleType) -> None:
    # page 3 * 100 = 300; slot round_up(10, 256) = 256; unit round_up(max(256, 300), 256) = 512,
    # but gcd(512, 300) = 4 and 512 + 4 < 600: unit 3 (bytes 1536..2048) would hold no page
    # (1500..1800 and 1800..2100 straddle). 600 - 300 / k for k | 300 (300, 450, 500, 525, 540,
    # 550, 570, 575, 580, 585, 588, 590, 594, 595) has no multiple of 256 from 512 up, so the
    # unit is round_up(2 * 300 - 1, 256) = 768: 2 pages (slack 168) and 1 slot (slack 512).
    # 5000 // 768 = 6 units; page ids 4608 // 300 = 15.
    result = plan(api, [kv(FULL, 0, 100), const(LINEAR, 1, "conv", 10)], 3, 5000)
    assert (result.unit_bytes, result.num_units) == (768, 6)
    assert result.groups == (
        ArenaGroup(FULL, "pages", 300, 2, 15, 168),
        ArenaGroup(LINEAR, "state", 256, 1, 6, 512),
    )


def test_zero_byte_components_take_no_room(api: ModuleType) -> None:
    # page group: k has no bytes (offset 0, nbytes 0), v 4 * 8 = 32 at 0; page 32.
    # state (alignment 64): a at 0 (100), b at round_up(100) = 128 with 0 bytes, c at 128 (1);
    # slot round_up(129) = 192 = unit (> 32): 6 pages, slack 0.
    comps = [
        kv("g", 0, 0, "k"),
        kv("g", 0, 8, "v"),
        const("s", 1, "a", 100),
        const("s", 1, "b", 0),
        const("s", 1, "c", 1),
    ]
    result = plan(api, comps, 4, 192 * 2, alignment=64)
    assert (result.unit_bytes, result.num_units) == (192, 2)
    assert [(c.offset, c.nbytes) for c in result.components] == [
        (0, 0),
        (0, 32),
        (0, 100),
        (128, 0),
        (128, 1),
    ]
    assert result.groups == (ArenaGroup("g", "pages", 32, 6, 12, 0), ArenaGroup("s", "state", 192, 1, 2, 0))


def test_default_alignment_is_256(api: ModuleType) -> None:
    comps = [kv(FULL, 0, 8), const(LINEAR, 1, "conv", 300)]  # slot round_up(300, 256) = 512
    assert api.plan_arena(comps, 16, 10**6) == api.plan_arena(comps, 16, 10**6, alignment=256)
    assert api.plan_arena(comps, 16, 10**6).unit_bytes == 512


def test_numpy_ints_are_ints(api: ModuleType) -> None:
    comps = [ComponentSpec(FULL, np.int64(0), "kv", np.int32(100), np.uint8(0))]  # type: ignore[arg-type]
    assert api.plan_arena(comps, np.int64(3), np.uint64(900), alignment=np.int16(8)) == api.plan_arena(
        [kv(FULL, 0, 100)], 3, 900, alignment=8
    )


def test_huge_ints_are_exact(api: ModuleType) -> None:
    # page 2**40 and 2**40 + 1 (coprime): lcm about 2**80 > 4 pages, so the unit would be 2**40 + 1,
    # where the unit at bytes 2**40 + 1 .. 2**41 + 2 holds no page of 2**40 (gcd 1); no k in 2..64
    # divides 2**40 + 1 (= 257 * 4278255361), so the unit is 2 * (2**40 + 1) - 1 = 2**41 + 1. A
    # budget beyond u64 (2**70) gives 2**70 // (2**41 + 1) = 2**29 - 1 units, all of it in u64.
    unit = 2**41 + 1
    comps = [kv("a", 0, 2**40), kv("b", 1, 2**40 + 1)]
    result = api.plan_arena(comps, 1, 2**70)
    assert (result.unit_bytes, result.num_units) == (unit, 2**70 // unit)
    assert result.groups[0] == ArenaGroup("a", "pages", 2**40, 2, result.num_units * unit // 2**40, 1)


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("comps", "page_size", "budget", "alignment", "error", "message"),
    [
        ([], 16, 10**9, 256, ValueError, EMPTY),
        (
            [ComponentSpec("g", 0, "x", 4, 8)],
            16,
            10**9,
            256,
            ValueError,
            MIXES.format("g"),
        ),  # in one component
        (
            [kv("g", 0, 4), const("h", 1, "s", 8), const("g", 2, "s", 8)],
            16,
            10**9,
            256,
            ValueError,
            MIXES.format("g"),
        ),
        (
            [kv("a", 0, 4), ComponentSpec("z", 1, "kv", 0, 0)],
            16,
            10**9,
            256,
            ValueError,
            NO_BYTES.format("z"),
        ),
        ([const("s", 0, "a", 0), const("s", 0, "b", 0)], 16, 10**9, 256, ValueError, NO_BYTES.format("s")),
        # groups are checked in first-appearance order
        (
            [ComponentSpec("z", 0, "kv", 0, 0), ComponentSpec("m", 1, "x", 1, 1)],
            16,
            10**9,
            256,
            ValueError,
            NO_BYTES.format("z"),
        ),
        (
            [ComponentSpec("m", 0, "x", 1, 1), ComponentSpec("z", 1, "kv", 0, 0)],
            16,
            10**9,
            256,
            ValueError,
            MIXES.format("m"),
        ),
        # budget: page 16 is the unit; 31 bytes are 1 unit, 0 bytes none
        ([kv("g", 0, 1)], 16, 31, 256, ValueError, NEED_TWO.format(31, 1, 16)),
        ([kv("g", 0, 1)], 16, 0, 256, ValueError, NEED_TWO.format(0, 0, 16)),
        ([const("s", 0, "a", 1)], 16, 2**9 - 1, 256, ValueError, NEED_TWO.format(511, 1, 256)),
        # arguments, in order: page_size, budget_bytes, alignment, components, then emptiness
        ([kv("g", 0, 1)], 0, 100, 256, ValueError, "page_size must be > 0, got 0"),
        ([kv("g", 0, 1)], -3, -1, 0, ValueError, "page_size must be > 0, got -3"),
        ([kv("g", 0, 1)], True, 100, 256, TypeError, "page_size must be an int, not bool"),
        ([kv("g", 0, 1)], 16.0, 100, 256, TypeError, "page_size must be an int, got float"),
        ([kv("g", 0, 1)], 16, -1, 0, ValueError, "budget_bytes must be >= 0, got -1"),
        ([kv("g", 0, 1)], 16, "100", 256, TypeError, "budget_bytes must be an int, got str"),
        ([kv("g", 0, 1)], 16, 100, 0, ValueError, "alignment must be > 0, got 0"),
        ([], 16, 100, -256, ValueError, "alignment must be > 0, got -256"),
        ([kv("g", 0, 1)], 16, 100, False, TypeError, "alignment must be an int, not bool"),
        ([kv("g", 0, -1)], 16, 100, 256, ValueError, "components[0].bytes_per_slot must be >= 0, got -1"),
        (
            [kv("g", 0, 1), const("s", 1, "a", -5)],
            16,
            100,
            256,
            ValueError,
            "components[1].const_bytes must be >= 0, got -5",
        ),
        (
            [ComponentSpec("g", "0", "kv", 1, 0)],  # type: ignore[arg-type]
            16,
            100,
            256,
            TypeError,
            "components[0].layer must be an int, got str",
        ),
        (
            [ComponentSpec("g", 0, "kv", True, 0)],
            16,
            100,
            256,
            TypeError,
            "components[0].bytes_per_slot must be an int, not bool",
        ),
    ],
)
def test_errors(
    api: ModuleType,
    comps: list[ComponentSpec],
    page_size: Any,
    budget: Any,
    alignment: Any,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error) as info:
        api.plan_arena(comps, page_size, budget, alignment=alignment)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("comps", "page_size", "budget", "alignment", "what"),
    [
        # page_size and alignment must fit u64 even where unused (docs/sizing-api.md: the
        # arena's sizes are u64 on both implementations)
        ([const("s", 0, "a", 100)], 2**200, 768, 256, "page_size"),
        ([kv("g", 0, 100)], 16, 4807, 2**200, "alignment"),
        ([kv("g", 0, 2**100)], 2**100, 10**9, 1, "page_size"),
        # sizes past u64: the page, the slot, the unit, in that order
        ([kv("g", 0, 2**60)], 32, 10**9, 1, "page_bytes of group g: page_size * sum of its bytes_per_slot"),
        ([const("s", 0, "a", 2**64)], 16, 10**9, 1, "slot_bytes: the state components, each aligned"),
        # a page of 2**63 + 1 bytes and a state slot of 2**63 (one byte aligned to 2**63): the
        # unit, the larger of the two rounded up to 2**63, is 2**64
        ([kv("g", 0, 2**63 + 1), const("s", 1, "a", 1)], 1, 10**6, 2**63, "unit_bytes"),
        # a budget past u64: units past u64
        ([kv("g", 0, 1)], 1, 2**70, 1, "num_units = budget_bytes // unit_bytes"),
    ],
)
def test_sizes_past_u64_are_overflow_errors_on_both(
    api: ModuleType, comps: list[ComponentSpec], page_size: int, budget: int, alignment: int, what: str
) -> None:
    got = outcome(lambda: api.plan_arena(comps, page_size, budget, alignment=alignment))
    assert (got.error, got.message) == (OverflowError, f"{what} does not fit in an unsigned 64-bit integer")


# --- native against the reference ----------------------------------------------------------------

#: Page groups (per-token bytes) and state groups (constant bytes); two of each kind, so state
#: groups interleave in one slot.
PAGE_GROUPS, STATE_GROUPS = ["full", "swa"], ["lin", "mamba"]
ARENA_GROUPS = st.sampled_from(PAGE_GROUPS + STATE_GROUPS)
ARENA_NAMES = st.sampled_from(["kv", "k", "v", "conv", "ssm"])
ONE_IN_TEN = st.integers(0, 9)
#: Component sizes: mostly realistic, some 0 (a group with no bytes), some far past u64.
ARENA_SIZES = st.one_of(st.integers(1, 4096), sizes(small=512), wide_sizes())


@st.composite
def arena_components(
    draw: st.DrawFn, ints: st.SearchStrategy[int] = ARENA_SIZES, max_size: int = 8
) -> list[ComponentSpec]:
    """Components of page and state groups; now and then one of the other kind (a mixed group)."""
    comps = []
    for _ in range(draw(st.integers(0, max_size))):
        group = draw(ARENA_GROUPS)
        per_token = (group in PAGE_GROUPS) != (draw(ONE_IN_TEN) == 0)
        nbytes = draw(ints)
        comps.append(
            ComponentSpec(
                group,
                draw(st.integers(0, 7)),
                draw(ARENA_NAMES),
                nbytes if per_token else 0,
                0 if per_token else nbytes,
            )
        )
    return comps


PAGE_SIZES = st.one_of(st.integers(1, 64), st.sampled_from([16, 128, 2**64]), mostly_valid)
ALIGNMENTS = st.one_of(st.sampled_from([1, 8, 64, 256, 4096]), mostly_valid)
RAW_BUDGETS = st.one_of(st.integers(0, 10**10), mostly_valid, wide_sizes())
#: A budget of this many units (plus a remainder), when the components have a unit; else a raw one.
UNIT_COUNTS = st.one_of(st.none(), st.integers(0, 5000), st.sampled_from([2**32, 2**64, 2**100]))


def arena_sizes(result: ArenaPlan | None) -> list[int]:
    """The sizes a plan computes (not the page size, alignment and layers it hands back)."""
    if result is None:
        return []
    values = [result.unit_bytes, result.num_units]
    for group in result.groups:
        values += [group.item_bytes, group.per_unit, group.num_ids, group.slack_bytes]
    for comp in result.components:
        values += [comp.offset, comp.nbytes]
    return values


def check_arena(comps: list[ComponentSpec], page_size: int, budget: int, alignment: int) -> Outcome:
    """Native and reference agree (docs/sizing-api.md); returns the native outcome."""

    def call(api: ModuleType) -> Any:
        return api.plan_arena(comps, page_size, budget, alignment=alignment)

    native, ref = outcome(lambda: call(flat_kvcache)), outcome(lambda: call(reference))
    context = f"native {native}, reference {ref}"
    if ref.error is None:
        check_layout(ref.value, comps, budget)
        too_big = [v for v in arena_sizes(ref.value) if v > U64_MAX]
        if too_big:
            assert native.error is OverflowError, f"native must overflow for {too_big[0]}: {context}"
            assert any(name in native.message for name in ARGUMENTS), f"names no argument: {context}"
            return native
    assert native == ref, context
    return native


def budget_for(
    comps: list[ComponentSpec], page_size: int, alignment: int, units: int | None, raw: int
) -> int:
    """``units`` whole units of the reference's plan plus a remainder, or ``raw`` without a unit."""
    if units is None:
        return raw
    try:
        # u64::MAX bytes: at least 2 units of any unit up to half of it, never past u64 units.
        unit = reference.plan_arena(comps, page_size, U64_MAX, alignment=alignment).unit_bytes
    except (ValueError, TypeError, OverflowError):
        return raw
    return units * unit + abs(raw) % unit


@pytest.mark.properties
@given(
    comps=arena_components(),
    page_size=PAGE_SIZES,
    alignment=ALIGNMENTS,
    units=UNIT_COUNTS,
    raw=RAW_BUDGETS,
)
@example(comps=[kv("g", 0, U64_MAX)], page_size=1, alignment=1, units=None, raw=2**66)  # 4 units of u64::MAX
@example(comps=[kv("g", 0, 2**62)], page_size=4, alignment=1, units=None, raw=2**66)  # a page of 2**64
@example(  # pages 2**63 and 2**62: lcm 2**63 <= 4 * 2**63 (beyond u64); 2 units make 2**64 bytes
    comps=[kv("a", 0, 2**63), kv("b", 1, 2**62)], page_size=1, alignment=1, units=None, raw=2**64
)
@example(  # coprime pages whose lcm (about 2**66) is beyond u64, the unit (the larger page) is not
    comps=[kv("a", 0, 2**33 - 1), kv("b", 1, 2**33)], page_size=1, alignment=1, units=None, raw=2**40
)
@example(  # three pages whose lcm is far beyond u64; the unit is the largest
    comps=[kv("a", 0, 2**31 - 1), kv("b", 1, 2**31), kv("c", 2, 2**31 - 3)],
    page_size=2**20,
    alignment=1,
    units=None,
    raw=2**60,
)
@example(
    comps=[kv("g", 0, 0), const("s", 1, "a", 1)], page_size=2**200, alignment=8, units=3, raw=0
)  # times zero
@example(comps=[const("s", 0, "a", U64_MAX)], page_size=1, alignment=1, units=2, raw=0)  # a slot of u64::MAX
@example(comps=[const("s", 0, "a", U64_MAX)], page_size=1, alignment=2, units=2, raw=0)  # rounded past u64
@example(
    comps=[const("s", 0, "a", 2**63), const("s", 0, "b", 2**63)], page_size=1, alignment=1, units=2, raw=0
)
@example(comps=[kv("g", 0, 1)], page_size=1, alignment=1, units=None, raw=2**64)  # 2**64 units
@example(comps=[kv("g", 0, 1)], page_size=1, alignment=1, units=None, raw=U64_MAX)  # u64::MAX units
@example(comps=[], page_size=2**200, alignment=2**200, units=None, raw=2**200)
@example(  # two state groups interleaved in the slot: in input order
    comps=[const("lin", 0, "a", 100), const("mamba", 1, "b", 100), const("lin", 2, "c", 100)],
    page_size=16,
    alignment=64,
    units=4,
    raw=0,
)
def test_plan_arena_agrees(
    comps: list[ComponentSpec], page_size: int, alignment: int, units: int | None, raw: int
) -> None:
    check_arena(comps, page_size, budget_for(comps, page_size, alignment, units, raw), alignment)


@pytest.mark.properties
@given(
    comps=arena_components(ints=i32(low=0), max_size=3),
    page_size=i32(low=1),
    alignment=i32(low=1),
    units=st.one_of(st.none(), st.integers(0, 64)),
    raw=i32(low=0),
)
def test_plan_arena_never_overflows_on_32_bit_inputs(
    comps: list[ComponentSpec], page_size: int, alignment: int, units: int | None, raw: int
) -> None:
    budget = budget_for(comps, page_size, alignment, units, raw)
    if budget > 2**31 - 1:
        budget = raw
    native = check_arena(comps, page_size, budget, alignment)
    assert native.error is not OverflowError, native


@pytest.mark.parametrize("api", BOTH)
@given(
    comps=arena_components(ints=st.integers(0, 300), max_size=6),
    page_size=st.integers(1, 32),
    alignment=st.sampled_from([1, 3, 8, 64, 256]),
    units=st.integers(0, 40),
    raw=st.integers(0, 10**6),
)
def test_layout_properties_hold(
    api: ModuleType, comps: list[ComponentSpec], page_size: int, alignment: int, units: int, raw: int
) -> None:
    budget = budget_for(comps, page_size, alignment, units, raw)
    result = outcome(lambda: api.plan_arena(comps, page_size, budget, alignment=alignment))
    if result.error is None:
        check_layout(result.value, comps, budget)
