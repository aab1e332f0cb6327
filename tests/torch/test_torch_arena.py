"""allocate_arena: the SPEC 13 arena's views, proved on data without a model.

Every view of a page id (or state slot) writes exactly the bytes the layout says, inside the
unit that holds the id; values round-trip through the views with no aliasing between groups,
layers or units; reads of NaN-poisoned fresh pages show that exactly the written pages are
read; a shifted page id fails the comparison; unit 0 stays zeros.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
from helpers import missing

try:
    import torch
except ImportError as exc:
    missing("torch", exc)

import flat_kvcache
from flat_kvcache import ArenaPlan
from flat_kvcache.torch import ArenaBuffers, ModelShape, allocate_arena

pytestmark = pytest.mark.torch

PAGE = 4
UNITS = 16
#: The background byte of (a): no element a test writes has it in every byte (0.0 is all zeros).
BACKGROUND = 0xAB


def hybrid(kv_dtype: torch.dtype) -> ModelShape:
    """2 full-attention + 2 state layers; 3 heads make a 768-byte page that does not divide the
    2,560-byte state slot, so some pages straddle two units and some units hold fewer pages."""
    return ModelShape(
        layer_types=("full_attention", "linear_attention", "full_attention", "linear_attention"),
        num_kv_heads=3,
        head_dim=8,
        kv_dtype=kv_dtype,
        state_shapes={"conv": (12, 3), "ssm": (4, 8, 7)},
        state_dtypes={"conv": kv_dtype, "ssm": torch.float32},
    )


def sliding_full(sliding: int, full: int) -> ModelShape:
    return ModelShape(
        layer_types=("sliding_attention",) * sliding + ("full_attention",) * full,
        sliding_window=8,
        num_kv_heads=2,
        head_dim=8,
        kv_dtype=torch.bfloat16,
    )


SHAPES = {
    "hybrid-fp16": lambda: hybrid(torch.float16),
    "hybrid-bf16": lambda: hybrid(torch.bfloat16),
    # pages of 512 and 768 bytes: the unit is their lcm, 1,536 bytes (3 and 2 pages, no slack)
    "sliding2-full3": lambda: sliding_full(2, 3),
    # pages of 1,280 and 1,536 bytes: lcm 7,680 > 4 pages, so the unit is the largest page
    "sliding5-full6": lambda: sliding_full(5, 6),
}


@dataclass
class Case:
    shape: ModelShape
    plan: ArenaPlan
    arena: ArenaBuffers

    @property
    def unit_bytes(self) -> int:
        return self.plan.unit_bytes

    def page_groups(self) -> list[str]:
        return [g.group_id for g in self.plan.groups if g.kind == "pages"]

    def state_groups(self) -> list[str]:
        return [g.group_id for g in self.plan.groups if g.kind == "state"]

    def layers(self, group_id: str) -> list[int]:
        return [c.layer for c in self.plan.components if c.group_id == group_id and c.component == "kv"]

    def state_layers(self) -> list[tuple[int, str]]:
        return [(c.layer, c.component) for c in self.plan.components if c.component != "kv"]

    def offset(self, layer: int, component: str) -> int:
        (found,) = (c.offset for c in self.plan.components if (c.layer, c.component) == (layer, component))
        return found

    def handed_out(self, group_id: str) -> Iterator[tuple[int, int]]:
        """(unit, id) of every id of a group in units 1.. (the ones the engine can hand out)."""
        for unit in range(1, self.plan.num_units):
            for page in self.arena.pages_of_unit(group_id, unit):
                yield unit, page


def make(name: str) -> Case:
    shape = SHAPES[name]()
    components = shape.components()
    unit = flat_kvcache.plan_arena(components, PAGE, 1 << 30).unit_bytes
    plan = flat_kvcache.plan_arena(components, PAGE, UNITS * unit)
    return Case(shape, plan, allocate_arena(shape, plan, "cpu"))


@pytest.fixture(params=sorted(SHAPES))
def case(request: pytest.FixtureRequest) -> Case:
    return make(request.param)


def kv_half(shape: ModelShape) -> int:
    """Bytes of K (or V) of one layer in one page, from first principles."""
    return PAGE * shape.num_kv_heads * shape.head_dim * shape.kv_dtype.itemsize


def random_like(view: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Finite random values of ``view``'s shape and dtype, none of them zero."""
    values = torch.rand(view.shape, generator=generator, dtype=torch.float32) + 1.0
    return values.to(view.dtype)


# --- the layout ---------------------------------------------------------------------------------


def test_plan_matches_first_principles(case: Case) -> None:
    half = kv_half(case.shape)
    for group in case.plan.groups:
        if group.kind == "pages":
            assert group.item_bytes == 2 * half * len(case.layers(group.group_id))
            # the group's layers lie side by side in its page, in layer order
            offsets = [case.offset(layer, "kv") for layer in case.layers(group.group_id)]
            assert offsets == [2 * half * i for i in range(len(offsets))]
    assert case.arena.arena.numel() == case.plan.num_units * case.unit_bytes
    assert case.arena.arena.dtype == torch.uint8


def test_view_shapes_dtypes_and_strides(case: Case) -> None:
    shape, plan = case.shape, case.plan
    for group_id in case.page_groups():
        group = case.arena.groups[group_id]
        item = shape.kv_dtype.itemsize
        for layer in case.layers(group_id):
            assert case.arena.group_of(layer) == group_id
            for view in (case.arena.k(layer), case.arena.v(layer)):
                assert view.shape == (group.num_ids, PAGE, shape.num_kv_heads, shape.head_dim)
                assert view.dtype == shape.kv_dtype
                assert view.stride() == (
                    group.item_bytes // item,
                    shape.num_kv_heads * shape.head_dim,
                    shape.head_dim,
                    1,
                )
                assert view.untyped_storage().data_ptr() == case.arena.arena.untyped_storage().data_ptr()
    for layer, component in case.state_layers():
        view = case.arena.state(layer, component)
        assert shape.state_shapes is not None and shape.state_dtypes is not None
        dtype = shape.state_dtypes[component]
        assert view.shape == (plan.num_units, *shape.state_shapes[component])
        assert view.dtype == dtype
        assert view.stride()[0] == case.unit_bytes // dtype.itemsize
        assert view[1].is_contiguous()


def test_pages_of_unit_and_unit_of_agree_with_byte_ranges(case: Case) -> None:
    """A page belongs to the unit that holds all its bytes; one that straddles two belongs to none."""
    for group_id in case.page_groups():
        group = case.arena.groups[group_id]
        listed = {
            page: unit
            for unit in range(case.plan.num_units)
            for page in case.arena.pages_of_unit(group_id, unit)
        }
        for page in range(group.num_ids):
            start, end = page * group.item_bytes, (page + 1) * group.item_bytes
            unit = start // case.unit_bytes
            if end <= (unit + 1) * case.unit_bytes:
                assert listed[page] == unit == case.arena.unit_of(group_id, page)
            else:
                assert page not in listed
                with pytest.raises(ValueError, match=f"page {page} .* straddles units {unit} and {unit + 1}"):
                    case.arena.unit_of(group_id, page)
        for unit in range(case.plan.num_units):
            assert len(case.arena.pages_of_unit(group_id, unit)) <= group.per_unit
    for group_id in case.state_groups():
        for unit in range(case.plan.num_units):
            assert case.arena.pages_of_unit(group_id, unit) == range(unit, unit + 1)
            assert case.arena.unit_of(group_id, unit) == unit


def test_the_straddling_shapes_do_straddle() -> None:
    """The cases cover a page that straddles two units and a unit holding fewer than per_unit."""
    for name in ("hybrid-fp16", "sliding5-full6"):
        got = make(name)
        group = min((got.arena.groups[g] for g in got.page_groups()), key=lambda g: g.item_bytes)
        group_id = group.group_id
        counts = [len(got.arena.pages_of_unit(group_id, u)) for u in range(got.plan.num_units)]
        assert sum(counts) < group.num_ids
        if name == "hybrid-fp16":
            assert min(counts) < group.per_unit == max(counts)


# --- (a) every view writes exactly its bytes, inside its unit -----------------------------------


def changed_bytes(arena: torch.Tensor) -> tuple[int, int]:
    """The one contiguous range of bytes that differ from BACKGROUND, as (start, end)."""
    changed = (arena != BACKGROUND).nonzero().flatten()
    assert changed.numel() > 0
    start, end = int(changed[0]), int(changed[-1]) + 1
    assert changed.numel() == end - start, "the written bytes are not contiguous"
    return start, end


def test_each_view_writes_exactly_its_bytes_inside_its_unit(case: Case) -> None:
    raw = case.arena.arena
    half = kv_half(case.shape)
    for group_id in case.page_groups():
        page_bytes = case.arena.groups[group_id].item_bytes
        for unit, page in case.handed_out(group_id):
            for layer in case.layers(group_id):
                offset = case.offset(layer, "kv")
                for view, extra in ((case.arena.k(layer), 0), (case.arena.v(layer), half)):
                    raw.fill_(BACKGROUND)
                    view[page] = 0.0
                    start = page * page_bytes + offset + extra
                    assert changed_bytes(raw) == (start, start + half)
                    assert unit * case.unit_bytes <= start and start + half <= (unit + 1) * case.unit_bytes
    for group_id in case.state_groups():
        for unit, slot in case.handed_out(group_id):
            for layer, component in case.state_layers():
                raw.fill_(BACKGROUND)
                view = case.arena.state(layer, component)
                view[slot] = 0.0
                start = slot * case.unit_bytes + case.offset(layer, component)
                assert changed_bytes(raw) == (start, start + view[slot].numel() * view.dtype.itemsize)
                assert changed_bytes(raw)[1] <= (unit + 1) * case.unit_bytes


# --- (b) round trip, no aliasing ----------------------------------------------------------------


def bind_units(case: Case) -> dict[str, list[int]]:
    """Units 1.. bound round-robin to the groups (every group gets at least one unit)."""
    groups = [g.group_id for g in case.plan.groups]
    bound: dict[str, list[int]] = {g: [] for g in groups}
    for unit in range(1, case.plan.num_units):
        bound[groups[(unit - 1) % len(groups)]].append(unit)
    assert all(bound.values())
    return bound


def write_everything(case: Case, seed: int = 0) -> dict[tuple[str, int, int, str], torch.Tensor]:
    """Random values through every view for every id in the units bound to its group; returns
    what was written, keyed by (view kind, layer, id, component)."""
    gen = torch.Generator().manual_seed(seed)
    written: dict[tuple[str, int, int, str], torch.Tensor] = {}
    for group_id, units in bind_units(case).items():
        ids = [i for u in units for i in case.arena.pages_of_unit(group_id, u)]
        if group_id in case.page_groups():
            for layer in case.layers(group_id):
                for kind, view in (("k", case.arena.k(layer)), ("v", case.arena.v(layer))):
                    for page in ids:
                        values = random_like(view[page], gen)
                        view[page] = values
                        written[(kind, layer, page, "kv")] = values
        else:
            for layer, component in case.state_layers():
                view = case.arena.state(layer, component)
                for slot in ids:
                    values = random_like(view[slot], gen)
                    view[slot] = values
                    written[("state", layer, slot, component)] = values
    return written


def read(case: Case, key: tuple[str, int, int, str]) -> torch.Tensor:
    kind, layer, index, component = key
    if kind == "state":
        return case.arena.state(layer, component)[index]
    return (case.arena.k(layer) if kind == "k" else case.arena.v(layer))[index]


def test_round_trip_across_groups_and_units_without_aliasing(case: Case) -> None:
    written = write_everything(case)
    kinds = {key[0] for key in written}
    assert kinds >= {"k", "v"} and (("state" in kinds) == bool(case.state_groups()))
    # every write came before every read: a write that reached another id, layer, group or unit
    # would have changed a value written before it
    for key, values in written.items():
        assert torch.equal(read(case, key), values), key


def test_writing_one_group_never_changes_another_groups_unit(case: Case) -> None:
    write_everything(case)
    bound = bind_units(case)
    for group_id, units in bound.items():
        before = case.arena.arena.clone()
        # rewrite every id of this group in its own units, through every view of the group
        for key in write_everything_keys(case, group_id, units):
            read(case, key).fill_(float("nan"))
        after = case.arena.arena
        own = torch.zeros_like(after, dtype=torch.bool)
        for unit in units:
            own[unit * case.unit_bytes : (unit + 1) * case.unit_bytes] = True
        assert torch.equal(after[~own], before[~own]), f"writing {group_id} changed another unit"
        assert not torch.equal(after[own], before[own])


def write_everything_keys(case: Case, group_id: str, units: list[int]) -> list[tuple[str, int, int, str]]:
    ids = [i for u in units for i in case.arena.pages_of_unit(group_id, u)]
    if group_id in case.page_groups():
        return [(kind, layer, i, "kv") for layer in case.layers(group_id) for kind in ("k", "v") for i in ids]
    return [("state", layer, i, component) for layer, component in case.state_layers() for i in ids]


# --- (c) NaN-poisoned fresh pages, (d) a shifted id fails ---------------------------------------


def write_request(
    case: Case, layer: int, table: list[int], tokens: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of ``tokens`` tokens written through the views at (table[t // P], t % P)."""
    gen = torch.Generator().manual_seed(seed)
    k, v = case.arena.k(layer), case.arena.v(layer)
    keys = random_like(k[0, 0].expand(tokens, -1, -1), gen)
    values = random_like(v[0, 0].expand(tokens, -1, -1), gen)
    pages = torch.tensor([table[t // PAGE] for t in range(tokens)])
    slots = torch.arange(tokens) % PAGE
    k[pages, slots] = keys
    v[pages, slots] = values
    return keys, values


def gather(case: Case, layer: int, table: list[int], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = torch.tensor([table[t // PAGE] for t in range(tokens)])
    slots = torch.arange(tokens) % PAGE
    return case.arena.k(layer)[pages, slots], case.arena.v(layer)[pages, slots]


def poison(case: Case) -> None:
    """Fill units 1.. with NaN (0xFF bytes: NaN in every float dtype here), as fresh memory may
    hold anything; unit 0 is left alone."""
    case.arena.arena[case.unit_bytes :].fill_(0xFF)


def handed_out_pages(case: Case, group_id: str) -> list[int]:
    """The pages of the units bound to ``group_id`` (:func:`bind_units`)."""
    return [page for unit in bind_units(case)[group_id] for page in case.arena.pages_of_unit(group_id, unit)]


def test_nan_poisoned_fresh_pages_only_written_pages_are_read(case: Case) -> None:
    poison(case)
    for group_id in case.page_groups():
        pages = handed_out_pages(case, group_id)
        assert torch.isnan(case.arena.k(case.layers(group_id)[0])[pages]).all()
        tokens = PAGE + PAGE // 2  # one full page and half of the next
        table, unwritten = pages[:2], pages[2:]
        for layer in case.layers(group_id):
            keys, values = write_request(case, layer, table, tokens, seed=layer)
            got_k, got_v = gather(case, layer, table, tokens)
            # a read of an unwritten slot would be NaN, and NaN never compares equal
            assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
            assert torch.equal(got_k, keys) and torch.equal(got_v, values)
            # the rest of the last page and the pages the request never got are still poison
            assert torch.isnan(case.arena.k(layer)[table[1], PAGE // 2 :]).all()
            assert torch.isnan(case.arena.v(layer)[table[1], PAGE // 2 :]).all()
            assert torch.isnan(case.arena.k(layer)[unwritten]).all()
            assert torch.isnan(case.arena.v(layer)[unwritten]).all()
        # the bytes of the pages the request never got were not touched at all
        page_bytes = case.arena.groups[group_id].item_bytes
        for page in unwritten:
            assert (case.arena.arena[page * page_bytes : (page + 1) * page_bytes] == 0xFF).all()
        # and the gather itself can see poison: the same read with an unwritten second page fails
        layer = case.layers(group_id)[-1]
        got_k, _ = gather(case, layer, [table[0], unwritten[0]], tokens)
        assert torch.isnan(got_k[PAGE:]).all() and not torch.equal(got_k, keys)


def test_a_shifted_page_id_reads_the_wrong_values(case: Case) -> None:
    poison(case)
    written = write_everything(case)  # finite values in every bound unit, poison elsewhere
    for group_id in case.page_groups():
        pages = handed_out_pages(case, group_id)
        layer = case.layers(group_id)[0]
        # next to another written page where the group has one, so the shifted read is finite
        page = next((p for p in pages if p + 1 in pages), pages[0])
        first = (written[("k", layer, page, "kv")], written[("v", layer, page, "kv")])
        right = gather(case, layer, [page], PAGE)
        assert all(torch.equal(a, b) for a, b in zip(right, first, strict=True))
        shifted = gather(case, layer, [page + 1], PAGE)
        if page + 1 in pages:
            assert torch.isfinite(shifted[0]).all()
        assert not any(torch.equal(a, b) for a, b in zip(shifted, first, strict=True))
    for group_id in case.state_groups():
        for layer, component in case.state_layers():
            view = case.arena.state(layer, component)
            for slot in handed_out_pages(case, group_id):
                assert torch.equal(view[slot], written[("state", layer, slot, component)])
                if slot + 1 < case.plan.num_units:
                    assert not torch.equal(view[slot + 1], written[("state", layer, slot, component)])


# --- (e) unit 0 stays zeros ---------------------------------------------------------------------


def test_unit_zero_starts_and_stays_zero(case: Case) -> None:
    assert not case.arena.unit(0).any()
    write_everything(case)
    poison(case)
    assert not case.arena.unit(0).any()
    for group_id in case.page_groups():
        for page in case.arena.pages_of_unit(group_id, 0):
            for layer in case.layers(group_id):
                for view in (case.arena.k(layer), case.arena.v(layer)):
                    assert torch.equal(view[page], torch.zeros_like(view[page]))
    for layer, component in case.state_layers():
        null = case.arena.state(layer, component)[0]
        assert torch.isfinite(null).all() and not null.any()


def test_allocate_zeroes_the_whole_arena() -> None:
    got = make("hybrid-bf16")
    assert not got.arena.arena.any()


# --- errors -------------------------------------------------------------------------------------


def test_layer_and_id_errors() -> None:
    got = make("hybrid-fp16")
    with pytest.raises(ValueError, match=r"layer 1 is a linear_attention .* no K/V"):
        got.arena.k(1)
    with pytest.raises(ValueError, match="layer 0 is a full_attention layer: it has no state"):
        got.arena.state(0, "ssm")
    with pytest.raises(KeyError, match="no state component 'nope'"):
        got.arena.state(1, "nope")
    with pytest.raises(IndexError, match="layer 4 out of range"):
        got.arena.v(4)
    with pytest.raises(KeyError, match="unknown group 'x'"):
        got.arena.unit_of("x", 0)
    with pytest.raises(IndexError, match=f"unit {UNITS} out of range"):
        got.arena.pages_of_unit("full_attention", UNITS)
    num_ids = got.arena.groups["full_attention"].num_ids
    with pytest.raises(IndexError, match=f"full_attention id {num_ids} out of range"):
        got.arena.unit_of("full_attention", num_ids)


def test_an_offset_not_a_multiple_of_the_itemsize_is_refused() -> None:
    got = make("hybrid-fp16")
    odd: list[Any] = [
        replace(c, offset=c.offset + 1) if c.component == "ssm" else c for c in got.plan.components
    ]
    plan = replace(got.plan, components=tuple(odd))
    with pytest.raises(
        ValueError, match=r"offset of \d+ bytes is not a multiple of the torch\.float32 itemsize"
    ):
        allocate_arena(got.shape, plan, "cpu")
    odd_stride = replace(got.plan, unit_bytes=got.plan.unit_bytes + 2, num_units=got.plan.num_units)
    with pytest.raises(
        ValueError, match=r"stride of .* bytes is not a multiple of the torch\.float32 itemsize"
    ):
        allocate_arena(got.shape, odd_stride, "cpu")


def test_a_plan_of_another_shape_is_refused() -> None:
    got = make("hybrid-fp16")
    with pytest.raises(ValueError, match="the plan's components are not the shape's"):
        allocate_arena(sliding_full(2, 3), got.plan, "cpu")
    with pytest.raises(TypeError, match="plan must be an ArenaPlan"):
        allocate_arena(got.shape, object(), "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the arena is 10 bytes"):
        ArenaBuffers(got.shape, got.plan, torch.zeros(10, dtype=torch.uint8))


def test_plan_arena_memory_is_plan_arena_of_the_budget() -> None:
    """``plan_arena_memory`` plans what ``plan_arena`` plans for the same components, page size
    and budget (on the CPU no allocator slack is set aside), and ``allocate_kv_buffers`` gives
    the same views as ``allocate_arena``."""
    from flat_kvcache.torch import ArenaMemoryPlan, allocate_kv_buffers, plan_arena_memory

    shape = hybrid(torch.float16)
    limits = {"max_live_requests": 4, "max_scheduled_tokens": 64, "max_context_len": 256}
    plan = plan_arena_memory(shape, page_size=PAGE, budget_bytes=1 << 20, **limits)
    assert isinstance(plan, ArenaMemoryPlan)
    assert plan.arena == flat_kvcache.plan_arena(shape.components(), PAGE, 1 << 20)
    assert (plan.allocator_slack_bytes, plan.page_size) == (0, PAGE)
    assert plan.total_bytes == plan.arena.num_units * plan.arena.unit_bytes <= 1 << 20
    buffers = allocate_kv_buffers(plan, "cpu")
    assert isinstance(buffers, ArenaBuffers) and buffers.plan == plan.arena
    assert buffers.arena.numel() == plan.total_bytes
    with pytest.raises(flat_kvcache.errors.ConfigError, match="max_live_requests=10000 live requests"):
        plan_arena_memory(
            shape, page_size=PAGE, budget_bytes=1 << 20, **{**limits, "max_live_requests": 10000}
        )
    with pytest.raises(ValueError, match="only CUDA devices report free memory"):
        plan_arena_memory(shape, page_size=PAGE, device="cpu", **limits)
