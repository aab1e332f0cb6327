"""Tiny random Hugging Face models computed through the flat cache match their own plain forward.

Every attention layer writes its K/V at the cache's write locations into the planned buffers and
reads its history back through the cache's block tables (flat_kvcache.torch.runner); the logits
of every computed position must equal the model's forward over the whole sequence. Freshly
allocated pages are filled with NaN, so a read of an unwritten slot fails the comparison.

With a host-memory tier, pages evicted from a small device pool come back from host buffers
through flat_kvcache.torch.TransferExecutor, and the logits must still match.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from helpers import missing, one_thread  # noqa: F401  (an autouse fixture)

try:
    import torch
    import transformers  # noqa: F401  (tiny_model builds its models)
except ImportError as exc:
    missing(exc.name or "torch/transformers", exc)

import flat_kvcache as fk
from flat_kvcache._types import SLIDING_WINDOW
from flat_kvcache.torch import (
    CaptureBuffers,
    HostKVBuffers,
    KVBuffers,
    TransferExecutor,
    allocate_kv_buffers,
)
from flat_kvcache.torch.rows import DeviceRows
from flat_kvcache.torch.runner import (
    PagedModelRunner,
    RequestRecord,
    max_logit_error,
    model_shape,
    plan_for_pages,
    reference_logits,
    run_decode_graph,
    run_greedy,
    tiny_model,
)

pytestmark = [pytest.mark.torch, pytest.mark.skipif(not fk.FLAT_KVCACHE, reason="needs the flat build")]

TOLERANCE = 1e-4
WINDOW = 8


def kv_buffers(runner: PagedModelRunner) -> KVBuffers:
    """The runner's SPEC 3 buffers (every runner of this file has them, none an arena)."""
    assert isinstance(runner.buffers, KVBuffers)
    return runner.buffers


def gpt_oss(layers: int = 4) -> Any:
    """GPT-OSS style: sliding/full alternation, attention sinks, a mixture of experts."""
    return tiny_model("gpt-oss", window=WINDOW, num_layers=layers, seed=0)


def llama() -> Any:
    """A plain full-attention model."""
    return tiny_model("llama", seed=1)


def setup(
    model: Any,
    *,
    page_size: int,
    num_pages: int,
    capture: str | None = None,
    rows: str | None = None,
    step_tokens: int = 64,
    max_batch: int = 4,
    max_context: int = 256,
    host_pages: int = 0,
    host_store: str = "write_through",
) -> PagedModelRunner:
    """Buffers planned for ``num_pages`` pages, a cache over the plan's groups (with a host tier
    of ``host_pages`` pages), and the runner."""
    plan = plan_for_pages(
        model_shape(model.config),
        page_size=page_size,
        num_pages=num_pages,
        max_live_requests=max_batch,
        max_scheduled_tokens=64,
        max_context_len=max_context,
    )
    assert plan.num_pages == num_pages
    buffers = allocate_kv_buffers(plan, "cpu")
    cache = fk.FlatKVCache(
        fk.kv_cache_specs(plan.groups),
        plan.num_pages,
        host_pages=host_pages,
        host_store=host_store,  # type: ignore[arg-type]
    )
    buffers_for_capture = None
    if capture is not None:
        buffers_for_capture = CaptureBuffers(
            plan.groups,
            max_batch_size=max_batch,
            max_context_len=max_context,
            sliding_offsets=capture == "windowed",
        )
    device_rows = None
    if rows is not None:
        # Full-history width for every group; a windowed sliding row holds the window plus one
        # step's scheduled tokens (at most ``step_tokens`` per request) plus one slot.
        widths = {spec.group_id: -(-(max_context + 1) // page_size) for spec in plan.groups}
        windowed = []
        if rows == "windowed":
            for spec in plan.groups:
                window = spec.sliding_window_tokens
                if spec.retention == SLIDING_WINDOW and window is not None:
                    widths[spec.group_id] = -(-(window + step_tokens) // page_size) + 1
                    windowed.append(spec.group_id)
        device_rows = DeviceRows(cache, max_batch, widths, windowed=windowed)
    return PagedModelRunner(
        model, cache, buffers, capture=buffers_for_capture, rows=device_rows, poison_new_pages=True
    )


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(1, 64, (length,), generator=generator)]


def assert_matches(model: Any, records: Mapping[str, RequestRecord]) -> None:
    error = max_logit_error(model, records)
    assert error <= TOLERANCE, f"paged logits differ from the model's own forward by {error}"


def computed_positions(record: RequestRecord) -> list[int]:
    return [p for positions, _ in record.computed for p in positions]


def test_gpt_oss_decodes_far_past_the_window_with_holes_and_slabs() -> None:
    model = gpt_oss()
    runner = setup(model, page_size=4, num_pages=64)
    assert runner.buffers.k(0) is runner.buffers.k(1)  # hybrid slabs: a sliding and a full layer share
    assert runner.group_of_layer == ["sliding_attention", "full_attention"] * 2
    seen_holes: list[int] = []

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        slot = runner.cache.slot_of("a")  # None once it finished
        assert slot == records["a"].slot
        if slot is not None:
            table = runner.cache.block_tables([slot])["sliding_attention"][0]
            seen_holes.append(int((table == 0).sum()))

    records = run_greedy(runner, {"a": prompt(13, 0)}, 40, on_step=on_step)
    assert len(records["a"].tokens) == 53
    assert max(seen_holes) >= (52 - WINDOW) // 4 - 1  # slid-out pages became holes (reclaimed)
    assert computed_positions(records["a"]) == list(range(52))  # only new tokens each step
    assert_matches(model, records)


def test_shared_prefix_hit_is_not_recomputed_and_chunked_prefill() -> None:
    model = gpt_oss(layers=2)
    runner = setup(model, page_size=4, num_pages=96)
    shared = prompt(30, 1)
    prompts = {"first": [*shared, *prompt(3, 2)], "second": [*shared, *prompt(5, 3)]}
    records = run_greedy(runner, prompts, 6, chunk_size=7, max_running=1)
    hit = records["second"].hits[0]
    assert hit == 28  # 7 full pages of the shared prefix; sliding pages of the window are cached too
    assert computed_positions(records["second"])[0] == hit
    assert computed_positions(records["first"]) == list(range(38))
    assert [len(p) for p, _ in records["first"].computed][:5] == [7, 7, 7, 7, 5]  # chunked prefill
    assert_matches(model, records)


def test_preemption_recompute_and_page_reuse_on_a_small_pool() -> None:
    model = gpt_oss(layers=2)
    runner = setup(model, page_size=4, num_pages=24)
    prompts = {f"r{i}": prompt(9 + 3 * i, 10 + i) for i in range(4)}
    records = run_greedy(runner, prompts, 12, chunk_size=8)
    assert sum(r.preemptions for r in records.values()) >= 1
    assert runner.cache.stats()["evictions"] >= 1  # cached pages were handed out again
    preempted = next(r for r in records.values() if r.preemptions)
    assert len(preempted.hits) == preempted.preemptions + 1
    assert max(preempted.hits[1:]) > 0  # the recompute starts from a prefix hit on its own pages
    assert_matches(model, records)


def test_a_pool_too_small_for_all_running_retracts_instead_of_failing() -> None:
    """Two requests that each fit alone but not together: when neither can be scheduled, the
    newest is retracted (SPEC 9) and re-added after, and both finish exactly."""
    model = llama()
    runner = setup(model, page_size=4, num_pages=12)  # 11 pages of 4 tokens: one request's 32
    prompts = {"a": prompt(20, 30), "b": prompt(20, 31)}
    records = run_greedy(runner, prompts, 12, chunk_size=4)
    assert records["b"].preemptions >= 1
    assert all(len(r.tokens) == 32 for r in records.values())
    assert_matches(model, records)


@pytest.mark.parametrize("mode", ["absolute", "windowed"])
def test_through_capture_buffers(mode: str) -> None:
    model = gpt_oss(layers=2)
    runner = setup(model, page_size=4, num_pages=64, capture=mode, max_context=64)
    assert runner.capture is not None
    records = run_greedy(runner, {"a": prompt(6, 4), "b": prompt(11, 5)}, 30)
    sliding = runner.capture.width("sliding_attention")
    assert sliding == (17 if mode == "absolute" else 4)  # ceil((64 + 1) / 4) vs ceil((8 + 1) / 4) + 1
    assert len(records["b"].tokens) // 4 > sliding or mode == "absolute"
    assert_matches(model, records)


@pytest.mark.parametrize("mode", ["absolute", "windowed"])
def test_through_persistent_rows_updated_by_deltas(mode: str) -> None:
    """The attention reads device tables kept only by applying ``update_rows()`` deltas (rows
    reused after finish and preemption, windowed sliding rows shifting): logits unchanged."""
    model = gpt_oss(layers=2)
    runner = setup(model, page_size=4, num_pages=40, rows=mode, step_tokens=8, max_batch=3, max_context=128)
    assert runner.rows is not None
    seen_cells: list[int] = []
    seen_offsets: list[int] = [0]

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        assert runner.rows is not None
        seen_cells.append(runner.rows.last_cells)
        for req in reqs:  # the device row is the request's block table (from its offset)
            row = records[req].slot  # row s is slot s
            assert runner.cache.slot_of(req) == row
            if row is None:
                continue  # finished this step
            for group, table in runner.cache.block_tables([row]).items():
                pages = torch.from_numpy(table[0])
                offset = int(runner.rows.offsets[group][row]) if group in runner.rows.offsets else 0
                seen_offsets.append(offset)
                shown = runner.rows.tables[group][row]
                assert torch.equal(shown[: len(pages) - offset], pages[offset:]), (group, req)
                assert (shown[len(pages) - offset :] == -1).all()

    prompts = {f"r{i}": prompt(7 + 5 * i, 20 + i) for i in range(5)}
    records = run_greedy(runner, prompts, 24, chunk_size=8, max_running=3, on_step=on_step)
    assert sum(r.preemptions for r in records.values()) >= 1 or len(prompts) > 3  # rows were reused
    assert 0 in seen_cells and max(seen_cells) > 0  # steps with nothing to copy, and some with cells
    if mode == "windowed":
        width = int(runner.rows.tables["sliding_attention"].shape[1])
        assert width == 5  # ceil((8 + 8) / 4) + 1, whatever the context length
        assert max(seen_offsets) > 0  # windows moved
    assert_matches(model, records)


def test_llama_full_attention_with_prefix_hit_and_per_layer_buffers() -> None:
    model = llama()
    runner = setup(model, page_size=8, num_pages=40)
    assert runner.buffers.k(0) is not runner.buffers.k(1)  # one label: per-layer buffers
    shared = prompt(20, 6)
    records = run_greedy(runner, {"x": [*shared, 1], "y": [*shared, 2, 3]}, 10, max_running=1)
    assert records["y"].hits == [16]
    assert_matches(model, records)


def test_gemma2_soft_capped_attention_matches() -> None:
    """Gemma-2's attention logit soft-capping is honoured by the paged forward (it was dropped
    once: the logits then differ by far more than the tolerance)."""
    model = tiny_model("gemma2", window=WINDOW, num_layers=2, seed=3)
    assert model.config.attn_logit_softcapping == 1.0
    runner = setup(model, page_size=4, num_pages=48)
    records = run_greedy(runner, {"x": prompt(13, 7), "y": prompt(9, 8)}, 12, max_running=2)
    assert_matches(model, records)


def test_mistral_window_without_layer_types_is_read_as_sliding() -> None:
    """A Mistral-style config (one ``sliding_window``, no ``layer_types``) is planned with every
    layer sliding, as the model attends, and runs past its window."""
    model = tiny_model("mistral", window=WINDOW, num_layers=2, seed=4)
    assert getattr(model.config, "layer_types", None) in (None, ["sliding_attention"] * 2)
    shape = model_shape(model.config)
    assert shape.layer_types == ("sliding_attention",) * 2 and shape.sliding_window == WINDOW
    runner = setup(model, page_size=4, num_pages=48)
    records = run_greedy(runner, {"x": prompt(11, 9)}, 20, max_running=1)
    assert_matches(model, records)


CHUNK = 8


def llama4() -> Any:
    """Llama 4 text: three chunked local attention layers (chunk 8) and a full NoPE layer."""
    return tiny_model("llama4", window=CHUNK, num_layers=4, seed=5)


@pytest.mark.parametrize("source", ["tables", "capture", "rows"])
def test_llama4_chunked_layers_past_two_chunk_boundaries_with_a_shared_prefix(source: str) -> None:
    """Every request runs past two chunk boundaries (prompt + generated > 2 C); the finished
    chunks' pages are reclaimed (holes) while the full layer keeps all; the second request hits
    the shared prefix up to a chunk-resumable boundary and is not recomputed there."""
    model = llama4()
    shape = model_shape(model.config)
    assert shape.layer_types == ("chunked_attention",) * 3 + ("full_attention",)
    assert shape.sliding_window == CHUNK  # a chunked layer's window entry is its chunk
    runner = setup(
        model,
        page_size=4,
        num_pages=48,
        capture="absolute" if source == "capture" else None,
        rows="absolute" if source == "rows" else None,
    )
    assert runner.chunks == {"chunked_attention": CHUNK, "full_attention": None}
    assert runner.windows == {"chunked_attention": None, "full_attention": None}
    seen_holes: list[int] = []

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        for req in reqs:
            slot = records[req].slot
            if slot is not None:
                tables = runner.cache.block_tables([slot])
                seen_holes.append(int((tables["chunked_attention"][0] == 0).sum()))
                assert (tables["full_attention"][0] > 0).all()

    shared = prompt(14, 40)
    prompts = {"first": [*shared, *prompt(3, 41)], "second": [*shared, *prompt(4, 42)]}
    records = run_greedy(runner, prompts, 12, chunk_size=5, max_running=1, on_step=on_step)
    assert all(len(r.tokens) > 2 * CHUNK + CHUNK for r in records.values())
    assert max(seen_holes) >= 2 * CHUNK // 4  # the pages of two finished chunks were reclaimed
    # 14 shared tokens: the boundary at 12 (page 3) resumes the chunk [8, 16), whose page 2 is cached.
    assert records["second"].hits == [12]
    assert computed_positions(records["second"])[0] == 12
    assert computed_positions(records["first"]) == list(range(28))
    assert_matches(model, records)


def test_llama4_decode_graph_path_on_fixed_tensors() -> None:
    model = llama4()
    runner = setup(model, page_size=4, num_pages=64, capture="absolute", max_batch=4, max_context=64)
    records = run_decode_graph(runner, {"a": prompt(5, 43), "b": prompt(11, 44)}, 20, use_graph=False)
    assert len(records["b"].tokens) == 31 > 3 * CHUNK
    assert_matches(model, records)


def test_llama4_without_the_chunk_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison has teeth: the same forward with the chunk dropped from the paged
    attention (every page still live: one prefill of 3 chunks, nothing reclaimed yet) differs
    from the model by far more than the tolerance; with it, it matches."""
    from flat_kvcache.torch import paged_attention as original

    model = llama4()
    tokens = prompt(3 * CHUNK - 1, 45)
    reference = reference_logits(model, tokens)
    chunks_seen: list[int | None] = []

    def errors(drop_chunk: bool) -> float:
        def attention(*args: Any, chunk_size: int | None = None, **kwargs: Any) -> torch.Tensor:
            chunks_seen.append(chunk_size)
            return original(*args, chunk_size=None if drop_chunk else chunk_size, **kwargs)

        monkeypatch.setattr("flat_kvcache.torch.runner.paged_attention", attention)
        runner = setup(model, page_size=4, num_pages=48)
        slot, hit = runner.add_request("a", tokens)
        assert hit == 0 and runner.cache.schedule([slot], [len(tokens)]).all()
        (logits,) = runner.step([slot], [tokens])
        monkeypatch.setattr("flat_kvcache.torch.runner.paged_attention", original)
        return float((logits - reference).abs().max())

    assert errors(drop_chunk=False) <= TOLERANCE
    assert chunks_seen == [CHUNK, CHUNK, CHUNK, None]  # the plan's chunk, per layer
    assert errors(drop_chunk=True) > 100 * TOLERANCE


def test_llama4_temperature_tuning_past_floor_scale_is_refused() -> None:
    """The NoPE layers' query temperature reads the packed token index, not the positions: a
    forward where that matters is refused rather than silently different."""
    model = llama4()
    model.config.floor_scale = 16
    runner = setup(model, page_size=4, num_pages=48)
    tokens = prompt(20, 46)
    slot, _ = runner.add_request("a", tokens)
    assert runner.cache.schedule([slot], [len(tokens)]).all()
    with pytest.raises(ValueError, match="attn_temperature_tuning"):
        runner.step([slot], [tokens])


def test_an_attention_argument_the_paged_forward_lacks_is_refused_by_name() -> None:
    from flat_kvcache.torch.runner import _paged_attention_forward

    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="does not implement alibi_slopes"):
        _paged_attention_forward(object(), q, q, q, None, alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match="does not implement dropout"):
        _paged_attention_forward(object(), q, q, q, None, dropout=0.1)


def test_a_broken_table_is_caught() -> None:
    """The comparison has teeth: a table shifted by one column makes the logits differ."""
    model = gpt_oss(layers=2)
    runner = setup(model, page_size=4, num_pages=32)
    cache = runner.cache
    original = cache.block_tables

    def shifted(slots: Sequence[int], out: Any = None) -> dict[str, Any]:
        tables: dict[str, Any] = original(list(slots))
        full = tables["full_attention"]
        full[:, 1:] = full[:, :-1].copy()
        return tables

    class Broken:
        def __getattr__(self, name: str) -> Any:
            return shifted if name == "block_tables" else getattr(cache, name)

    runner.cache = Broken()  # type: ignore[assignment]
    with pytest.raises((AssertionError, ValueError)):
        records = run_greedy(runner, {"a": prompt(10, 7)}, 6)
        assert_matches(model, records)


@pytest.mark.parametrize("mode", ["absolute", "windowed"])
def test_decode_graph_path_on_fixed_tensors(mode: str) -> None:
    """The CUDA-graph decode path (fixed tensors, capture buffers, unchecked attention), run eagerly."""
    model = llama_sliding()
    runner = setup(model, page_size=4, num_pages=64, capture=mode, max_batch=4, max_context=64)
    records = run_decode_graph(runner, {"a": prompt(5, 8), "b": prompt(9, 9)}, 24, use_graph=False)
    assert len(records["b"].tokens) == 33
    assert_matches(model, records)


def llama_sliding() -> Any:
    """A Mistral-style model with sliding/full alternation (no experts: graph-capturable)."""
    return tiny_model("qwen2", window=WINDOW, seed=2)


# -- the host-memory tier -------------------------------------------------------------------------


def with_host_tier(
    model: Any, *, num_pages: int, host_pages: int, host_store: str = "write_through", page_size: int = 4
) -> tuple[PagedModelRunner, TransferExecutor]:
    """A runner over a small device pool with a host tier, and the executor of its transfers."""
    runner = setup(
        model, page_size=page_size, num_pages=num_pages, host_pages=host_pages, host_store=host_store
    )
    host = HostKVBuffers(kv_buffers(runner).plan, host_pages)
    assert not host.pinned or torch.cuda.is_available()
    return runner, TransferExecutor(runner.cache, kv_buffers(runner), host)


def evicting_prompts(shared: list[int], fillers: int, seed: int) -> dict[str, list[int]]:
    """``first`` (the shared prefix and its own tokens), ``fillers`` unrelated prompts that take
    the whole device pool one after another, then ``second`` (the same prefix, other tokens)."""
    prompts = {"first": [*shared, *prompt(3, seed)]}
    for i in range(fillers):
        prompts[f"filler{i}"] = prompt(40, seed + 1 + i)
    prompts["second"] = [*shared, *prompt(5, seed + 100)]
    return prompts


@pytest.mark.parametrize(
    ("kind", "host_store"),
    [("gpt-oss", "write_through"), ("gpt-oss", "evict"), ("llama", "write_through")],
)
def test_host_tier_pages_evicted_from_the_device_come_back_on_a_prefix_hit(
    kind: str, host_store: str
) -> None:
    """Every request runs alone on a 24-page pool: the fillers evict the shared prefix's device
    pages (and poison them with NaN), so ``second`` hits the prefix only through host loads."""
    model = gpt_oss(layers=2) if kind == "gpt-oss" else llama()
    runner, executor = with_host_tier(model, num_pages=24, host_pages=128, host_store=host_store)
    shared = prompt(30, 11)
    loads: list[int] = []

    def on_step(
        step: int, reqs: Sequence[str], ns: Sequence[int], records: Mapping[str, RequestRecord]
    ) -> None:
        loads.append(int(runner.cache.stats()["host_loads"]))

    records = run_greedy(
        runner, evicting_prompts(shared, 3, 20), 6, max_running=1, on_step=on_step, transfers=executor
    )
    stats = runner.cache.stats()
    assert stats["evictions"] >= 7  # the fillers took the prefix's device pages
    assert stats["host_stores"] >= 7
    hit = records["second"].hits[0]
    assert hit == 28  # 7 full pages of the 30-token prefix, as without pressure
    assert stats["host_hits_tokens"] == hit  # all of it loaded from the host (0 without the tier)
    assert stats["host_loads"] >= 7  # the full group's 7 pages and the sliding window's
    assert max(loads) == stats["host_loads"]  # every load came with second's admission
    assert computed_positions(records["second"])[0] == hit  # the prefix was not recomputed
    assert runner.cache.transfers_in_flight() == 0  # run_greedy's last run acknowledged all
    runner.cache.check_invariants()
    assert_matches(model, records)


def test_host_tier_without_the_copies_is_caught() -> None:
    """The comparison has teeth: acknowledging the loads without copying leaves the filler's
    K/V in the loaded pages and the logits differ."""

    class AckOnly(TransferExecutor):
        def _copy(self, stores: Any, loads: Any, ids: list[Any]) -> tuple[int, int]:
            moved = super()._copy(stores, {}, ids)
            ids.extend(group_ids for group_ids, _, _ in loads.values())
            return moved

    model = gpt_oss(layers=2)
    runner, executor = with_host_tier(model, num_pages=24, host_pages=128)
    broken = AckOnly(runner.cache, kv_buffers(runner), executor.host)
    records = run_greedy(runner, evicting_prompts(prompt(30, 11), 3, 20), 6, max_running=1, transfers=broken)
    assert runner.cache.stats()["host_loads"] >= 1
    assert max_logit_error(model, records) > TOLERANCE


def test_a_request_with_loads_in_flight_is_not_scheduled_until_they_are_acked() -> None:
    model = gpt_oss(layers=2)
    runner, executor = with_host_tier(model, num_pages=24, host_pages=128)
    cache = runner.cache
    shared = prompt(30, 12)
    prompts = evicting_prompts(shared, 3, 30)
    late = prompts.pop("second")
    run_greedy(runner, prompts, 4, max_running=1, transfers=executor)

    slot, hit = runner.add_request("late", late)
    assert (slot, hit) == (0, 28)  # the only live request
    assert cache.loads_in_flight(slot) >= 1
    n = len(late) - hit
    with pytest.raises(ValueError, match="late"):
        cache.schedule([slot], [n])
    with pytest.raises(ValueError, match="late"):
        cache.schedule([slot], [0])  # not even a zero-token schedule
    assert cache.num_computed_tokens(slot) == hit  # the refused schedules changed nothing

    done = executor.run()
    assert done.loads == cache.stats()["host_loads"] >= 1
    assert done.acked == done.loads + done.stores
    assert cache.loads_in_flight(slot) == 0
    assert cache.schedule([slot], [n]).all()
    (logits,) = runner.step([slot], [late[hit:]])
    error = float((logits - reference_logits(model, late)[hit:]).abs().max())
    assert error <= TOLERANCE
    runner.release(slot)
    assert cache.slot_of("late") is None
    executor.run()
    cache.check_invariants()


def test_host_buffers_mirror_the_device_buffers_and_check_their_arguments() -> None:
    model = gpt_oss(layers=2)
    runner, executor = with_host_tier(model, num_pages=24, host_pages=10)
    host, plan = executor.host, kv_buffers(runner).plan
    assert list(host.tensors) == list(kv_buffers(runner).tensors)  # the same slabs, by name
    for name, device in kv_buffers(runner).tensors.items():
        assert host.tensors[name].shape[1:] == device.shape[1:]
        assert host.tensors[name].shape[0] == 10 * plan.page_size
        assert host.tensors[name].dtype == device.dtype and host.tensors[name].device.type == "cpu"
    assert host.nbytes() == 10 * plan.bytes_per_page
    assert executor.run().acked == 0  # nothing emitted yet
    with pytest.raises(ValueError, match="host_pages"):
        HostKVBuffers(plan, 0)
    with pytest.raises(TypeError, match="plan"):
        HostKVBuffers("plan", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pin_memory"):
        HostKVBuffers(plan, 4, pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host tier of 10 pages"):
        TransferExecutor(runner.cache, kv_buffers(runner), HostKVBuffers(plan, 4))
    with pytest.raises(TypeError, match="host"):
        TransferExecutor(runner.cache, kv_buffers(runner), kv_buffers(runner))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cache"):
        TransferExecutor(object(), kv_buffers(runner), host)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device pages"):
        TransferExecutor(
            fk.FlatKVCache(fk.kv_cache_specs(plan.groups), plan.num_pages + 1, host_pages=10),
            kv_buffers(runner),
            host,
        )
    no_tier = fk.FlatKVCache(fk.kv_cache_specs(plan.groups), plan.num_pages)
    with pytest.raises(ValueError, match="host tier of 0 pages"):
        TransferExecutor(no_tier, kv_buffers(runner), host)


# -- same-step sharing (FlatKVCache(register_on_schedule=True), docs/requests-api.md) ----------


def same_step_runner(model: Any, *, num_pages: int = 64) -> PagedModelRunner:
    """``setup``'s runner on a cache that registers a chunk's full pages when it is scheduled,
    with every K/V buffer filled with NaN first: a read of a slot no forward wrote is NaN."""
    plan = plan_for_pages(
        model_shape(model.config),
        page_size=4,
        num_pages=num_pages,
        max_live_requests=4,
        max_scheduled_tokens=64,
        max_context_len=256,
    )
    buffers = allocate_kv_buffers(plan, "cpu")
    for tensor in buffers.tensors.values():
        tensor.fill_(math.nan)
    cache = fk.FlatKVCache(fk.kv_cache_specs(plan.groups), plan.num_pages, register_on_schedule=True)
    return PagedModelRunner(model, cache, buffers, poison_new_pages=True)


#: A shared prefix of 24 tokens; the writer's first chunk ends inside its fifth page.
SHARED = 24
WRITER_CHUNK = 18


def same_step_prompts() -> tuple[list[int], list[int]]:
    shared = prompt(SHARED, 60)
    return [*shared, *prompt(5, 61)], [*shared, *prompt(7, 62)]


def admit_in_the_writers_step(runner: PagedModelRunner) -> tuple[int, int, list[int], list[int]]:
    """Writer ``a`` is scheduled for its first 18 tokens; then ``b``, with the same 24-token
    prefix, is added in the same step: it hits the 4 pages (16 tokens) the writer's chunk fills,
    not the fifth, which the chunk fills only in part. Returns both slots and token lists."""
    a_tokens, b_tokens = same_step_prompts()
    a, hit = runner.add_request("a", a_tokens)
    assert hit == 0
    assert runner.cache.schedule([a], [WRITER_CHUNK]).all()
    b, hit = runner.add_request("b", b_tokens)
    assert hit == 16
    full = runner.cache.block_tables([a, b])["full_attention"]
    assert list(full[1][:4]) == list(full[0][:4])  # the hitter's first pages are the writer's
    assert full[1][4] != full[0][4]  # the part-filled page is not shared
    assert runner.cache.schedule([b], [len(b_tokens) - 16]).all()
    return a, b, a_tokens, b_tokens


@pytest.mark.parametrize("order", ["writer_first", "hitter_first"])
def test_a_request_admitted_in_its_prefix_writers_step_reads_what_that_forward_writes(order: str) -> None:
    """Issue 38: B hits pages A's chunk fills, in the step that computes that chunk, and both
    run in one packed forward. Every attention layer writes the whole batch's K/V before it
    attends (``write_kv`` then ``paged_attention``), so B's attention reads A's K/V of this very
    forward, whatever the order of the two in the batch, and B's logits are the unpaged ones.
    The buffers start as NaN and fresh pages are poisoned: a page read before it is written
    gives NaN (``test_..._fails_when_the_hitter_reads_before_the_writer_writes`` shows it)."""
    model = gpt_oss(layers=2)
    runner = same_step_runner(model)
    a, b, a_tokens, b_tokens = admit_in_the_writers_step(runner)
    batch = [(a, a_tokens[:WRITER_CHUNK]), (b, b_tokens[16:])]
    if order == "hitter_first":
        batch.reverse()
    logits = dict(
        zip([s for s, _ in batch], runner.step([s for s, _ in batch], [t for _, t in batch]), strict=True)
    )
    a_error = (logits[a] - reference_logits(model, a_tokens[:WRITER_CHUNK])).abs().max()
    b_error = (logits[b] - reference_logits(model, b_tokens)[16:]).abs().max()
    assert float(a_error) <= TOLERANCE
    assert float(b_error) <= TOLERANCE


def test_a_same_step_hit_fails_when_the_hitter_reads_before_the_writer_writes() -> None:
    """The comparison has teeth: the same schedule, but B's forward runs before A's (a runner
    that did not batch them, or a kernel that attended before writing the step's K/V). B then
    reads pages A has not written: NaN, far from the unpaged logits; A, which reads only its
    own pages, still matches."""
    model = gpt_oss(layers=2)
    runner = same_step_runner(model)
    a, b, a_tokens, b_tokens = admit_in_the_writers_step(runner)
    (b_logits,) = runner.step([b], [b_tokens[16:]])
    (a_logits,) = runner.step([a], [a_tokens[:WRITER_CHUNK]])
    assert not bool(torch.isfinite(b_logits).all())
    assert float((a_logits - reference_logits(model, a_tokens[:WRITER_CHUNK])).abs().max()) <= TOLERANCE


def test_same_step_sharing_through_a_scheduler_loop() -> None:
    """The loop of ``flat-kvcache simulate`` in small: each step schedules the running requests,
    then admits waiting ones (each scheduled at once), then runs one forward; requests that
    share a prefix and arrive together hit each other's pages in their admission step, and every
    computed position matches the unpaged model."""
    model = gpt_oss(layers=2)
    runner = same_step_runner(model, num_pages=96)
    shared = prompt(21, 70)
    prompts = {f"r{i}": [*shared, *prompt(3 + i, 71 + i)] for i in range(3)}
    records = {req: RequestRecord(prompt=list(p), tokens=list(p)) for req, p in prompts.items()}
    running: list[str] = []
    waiting = list(prompts)
    cache = runner.cache

    def slot_of(req: str) -> int:
        slot = records[req].slot
        assert slot is not None
        return slot

    for _ in range(40):
        if not waiting and not running:
            break
        batch = [(req, len(records[req].tokens) - cache.num_computed_tokens(slot_of(req))) for req in running]
        assert cache.schedule([slot_of(req) for req, _ in batch], [n for _, n in batch]).all()
        while waiting:
            req = waiting.pop(0)
            slot, hit = runner.add_request(req, records[req].tokens)
            records[req].slot = slot
            records[req].hits.append(hit)
            n = len(records[req].tokens) - hit
            assert cache.schedule([slot], [n]).all()
            batch.append((req, n))
            running.append(req)
        ends = [cache.num_computed_tokens(slot_of(req)) for req, _ in batch]
        chunks = [records[req].tokens[end - n : end] for (req, n), end in zip(batch, ends, strict=True)]
        logits = runner.step([slot_of(req) for req, _ in batch], chunks)
        for (req, n), end, out in zip(batch, ends, logits, strict=True):
            record = records[req]
            record.computed.append((list(range(end - n, end)), out))
            record.tokens.append(int(out[-1].argmax()))
            cache.append_tokens([slot_of(req)], [record.tokens[-1]])
            if len(record.tokens) - len(record.prompt) >= 4:
                runner.release(slot_of(req))
                running.remove(req)
    assert [records[f"r{i}"].hits[0] for i in range(3)] == [0, 20, 20]  # 5 full pages, same step
    assert_matches(model, records)
