"""``flat_kvcache.cache_from_config``: from a model config (or a memory plan) to a ``FlatKVCache``
in one call.

The engine it builds must be the one a user would build by hand from the sizing API
(``group_specs_from_layer_types`` -> ``kv_cache_specs`` -> ``FlatKVCache``): the tests drive both
through the same calls and compare what they report.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import flat_kvcache as fk
import pytest
from flat_kvcache.config import CacheOptions
from flat_kvcache.presets import get_preset
from helpers import need

GPT_OSS_LAYERS = ["sliding_attention", "full_attention"] * 12


def by_hand(layer_types: list[str], window: Any, *, num_pages: int, page_size: int = 16) -> fk.FlatKVCache:
    groups = fk.group_specs_from_layer_types(layer_types, window, page_size=page_size)
    return fk.FlatKVCache(fk.kv_cache_specs(groups), num_pages)


def drive(cache: fk.FlatKVCache) -> dict[str, Any]:
    """A request past the sliding window, finished, then a second one sharing its prefix."""
    prompt = list(range(300))
    slot, hit_a = cache.add_request("a", prompt)
    assert (slot, hit_a) == (0, 0)
    assert cache.schedule([slot], [300]).all()
    for token in (7, 8, 9):
        cache.append_tokens([slot], [token])
        assert cache.schedule([slot], [1]).all()
    tables = {gid: table.tolist() for gid, table in cache.block_tables([slot]).items()}
    cache.finish([slot])
    slot_b, hit = cache.add_request("b", prompt)
    assert slot_b == slot  # the finished request's slot is free again
    return {
        "group_ids": list(cache.group_ids),
        "base_page_size": cache.base_page_size,
        "tables": tables,
        "hit": hit,
        "free": cache.num_free_pages,
    }


def test_exported() -> None:
    assert "cache_from_config" in fk.__all__ and fk.cache_from_config is fk.config.cache_from_config


@pytest.mark.parametrize("source", ["preset", "file", "folder", "dict"])
def test_every_model_source_builds_the_engine_a_user_builds_by_hand(tmp_path: Path, source: str) -> None:
    cfg = get_preset("gpt-oss-like")
    (tmp_path / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    model: Any = {
        "preset": "gpt-oss-like",
        "file": tmp_path / "config.json",
        "folder": str(tmp_path),
        "dict": cfg,
    }[source]
    cache = fk.cache_from_config(model, num_pages=200)
    got, want = drive(cache), drive(by_hand(GPT_OSS_LAYERS, 128, num_pages=200))
    assert got == want
    # What the by-hand engine reports, from SPEC 2 and 6: a sliding group (W=128) and a full one,
    # 16-token pages; after 303 tokens the sliding table has holed its first (302-128+1)//16 = 10
    # slots; the second request hits the 18 full pages of the cap (300 - 1) // 16.
    assert got["group_ids"] == ["sliding_attention", "full_attention"] and got["base_page_size"] == 16
    assert got["tables"]["sliding_attention"][0][:10] == [0] * 10
    assert got["hit"] == 18 * 16
    assert cache.num_free_pages + cache.stats()["pages_in_use"] == 199  # 200 pages less the null page


def test_page_size_and_several_windows() -> None:
    cache = fk.cache_from_config("multi-window-demo", num_pages=64, page_size=32)
    assert list(cache.group_ids) == ["sliding_attention_512", "sliding_attention_4096", "full_attention"]
    assert cache.base_page_size == 32 and cache.num_free_pages == 63


def test_engine_options_are_passed_on() -> None:
    prompt = list(range(64))
    off = fk.cache_from_config("llama3-8b-like", num_pages=32, enable_caching=False)
    on = fk.cache_from_config("llama3-8b-like", num_pages=32)
    for cache in (off, on):
        slot, _ = cache.add_request("a", prompt)
        assert cache.schedule([slot], [64]).all()
        cache.finish([slot])
    # (64 - 1) // 16 pages hit with caching on; both get slot 0 again
    assert (off.add_request("b", prompt), on.add_request("b", prompt)) == ((0, 0), (0, 48))
    events = fk.cache_from_config("llama3-8b-like", num_pages=32, enable_kv_events=True)
    slot, _ = events.add_request("a", prompt)
    assert events.schedule([slot], [64]).all()
    events.finish([slot])
    assert events.take_events()
    host = fk.cache_from_config("llama3-8b-like", num_pages=32, host_pages=5, host_store="evict")
    assert host.stats()["host_pages_total"] == 5


def test_options_are_the_engines() -> None:
    """Every option ``CacheOptions`` names is a keyword of ``FlatKVCache`` and the reverse, so
    nothing the engine takes is out of reach (the engine's defaults apply to those left out)."""
    engine = set(inspect.signature(fk.FlatKVCache).parameters) - {"specs", "num_pages"}
    assert set(CacheOptions.__annotations__) == engine


@pytest.mark.torch
def test_from_a_memory_plan() -> None:
    """A plan carries its groups (with the page size a state layer raised) and its page count."""
    need("torch")
    from flat_kvcache.torch import ModelShape, plan_kv_memory

    limits = {"max_live_requests": 4, "max_scheduled_tokens": 256, "max_context_len": 4096}
    shape = ModelShape.preset("qwen3.5-like")
    plan = plan_kv_memory(shape, page_size=16, budget_bytes=1 << 30, storage="equalized", **limits)
    assert plan.page_size > 16  # raised so a page holds a state snapshot
    cache = fk.cache_from_config(plan)
    assert list(cache.group_ids) == ["linear_attention", "full_attention"]
    assert cache.base_page_size == plan.page_size and cache.num_free_pages == plan.num_pages - 1
    with pytest.raises(TypeError, match="takes no num_pages= with a memory plan"):
        fk.cache_from_config(plan, num_pages=10)
    with pytest.raises(TypeError, match="takes no page_size= with a memory plan"):
        fk.cache_from_config(plan, page_size=16)


@pytest.mark.torch
def test_a_state_model_gets_the_arena_unless_it_asks_for_equal_pages() -> None:
    """SPEC 13 is the storage of a model with state layers: an arena memory plan builds the
    engine over its arena (its groups' ids index the plan's views; state pages of the checkpoint
    grain, 64), and equal pages (``num_pages``) are refused unless ``storage="equalized"`` asks
    for them. An attention-only model takes ``num_pages`` as before."""
    need("torch")
    from flat_kvcache.errors import ConfigError
    from flat_kvcache.torch import ModelShape, plan_arena_memory

    limits = {"max_live_requests": 4, "max_scheduled_tokens": 256, "max_context_len": 4096}
    plan = plan_arena_memory(ModelShape.preset("qwen3.5-like"), page_size=16, budget_bytes=1 << 30, **limits)
    cache = fk.cache_from_config(plan)
    assert list(cache.group_ids) == ["linear_attention", "full_attention"]
    stats = cache.arena_stats()
    assert stats is not None and stats["units_total"] == plan.arena.num_units - 1
    # A checkpoint every 64 tokens: a prompt of 300 is cut at 256, its body's end.
    slot, _ = cache.add_request("a", list(range(300)))
    assert cache.next_chunk(slot, 1000) == 256
    coarse = fk.cache_from_config(plan, state_grain=128)
    slot, _ = coarse.add_request("a", list(range(300)))
    assert coarse.next_chunk(slot, 1000) == 256  # 2 x 128
    slot, _ = coarse.add_request("b", list(range(200)))
    assert coarse.next_chunk(slot, 1000) == 128
    with pytest.raises(ValueError, match="state_grain must be a positive multiple of the page size 16"):
        fk.cache_from_config(plan, state_grain=24)
    with pytest.raises(TypeError, match="takes no num_pages= with a memory plan"):
        fk.cache_from_config(plan, num_pages=10)
    with pytest.raises(ConfigError, match="storage is the SPEC 13 arena: pass arena="):
        fk.cache_from_config("qwen3.5-like", num_pages=100)
    equal = fk.cache_from_config("qwen3.5-like", num_pages=100, storage="equalized")
    assert equal.arena_stats() is None and equal.num_free_pages == 99
    over = fk.cache_from_config("qwen3.5-like", arena=plan.arena)
    slot, _ = over.add_request("a", list(range(300)))
    assert over.next_chunk(slot, 1000) == 256
    with pytest.raises(ValueError, match="storage must be None or 'equalized'"):
        fk.cache_from_config("qwen3.5-like", num_pages=100, storage="arena")  # type: ignore[arg-type]
    assert fk.cache_from_config("gpt-oss-like", num_pages=100).num_free_pages == 99


@pytest.mark.parametrize(
    ("model", "kwargs", "error", "message"),
    [
        ("gpt-oss-like", {}, TypeError, "needs num_pages="),
        (42, {"num_pages": 8}, TypeError, "model must be a preset name, a config.json path, .* not int"),
        ("nope", {"num_pages": 8}, ValueError, "^model: unknown preset 'nope'"),
        ("/no/such/config.json", {"num_pages": 8}, FileNotFoundError, "^model: config file not found"),
        (
            {"model_type": "llama", "num_hidden_layers": 0},
            {"num_pages": 8},
            ValueError,
            "^model: config num_hidden_layers = 0: an int >= 1",
        ),
        ({"num_hidden_layers": 4}, {"num_pages": 8}, ValueError, "^model: config model_type is missing"),
        (
            {"layer_types": ["full_attention", "mamba"]},
            {"num_pages": 8},
            ValueError,
            "^model: config layer_types\\[1\\] = 'mamba': supported labels",
        ),
        (
            {"layer_types": ["sliding_attention"]},
            {"num_pages": 8},
            ValueError,
            "^model: config sliding_window = None: sliding layers need an int window",
        ),
        ("gpt-oss-like", {"num_pages": 0}, ValueError, "num_pages must be >= 1, got 0"),
        ("gpt-oss-like", {"num_pages": 8, "page_size": 0}, ValueError, "^page_size must be > 0, got 0"),
        ("gpt-oss-like", {"num_pages": 8, "page_size": True}, TypeError, "^page_size must be an int"),
        ("gpt-oss-like", {"num_pages": 8, "eviction_order": "lru"}, ValueError, "eviction_order must be"),
        ("gpt-oss-like", {"num_pages": 8, "bogus": 1}, TypeError, "bogus"),
    ],
)
def test_bad_arguments_are_named(
    model: Any, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        fk.cache_from_config(model, **kwargs)
