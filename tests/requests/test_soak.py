"""Soak at CI size: a seeded random stream of token-level calls, native == reference on every
call, then every request finished and no page leaked (the driver is benches/soak.py, which also
runs the long version and the RSS check)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from helpers import IN_CI, REPO_ROOT

#: Operations per seed: more in CI, where the profile is thorough.
OPS = 50_000 if IN_CI else 4_000


def _load_driver() -> ModuleType:
    path = REPO_ROOT / "benches" / "soak.py"
    spec = importlib.util.spec_from_file_location("flat_kvcache_soak_driver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


soak = _load_driver()


@pytest.mark.parametrize("seed", [0, 1])
def test_native_matches_reference_on_every_call_and_nothing_leaks(seed: int) -> None:
    stats = soak.run(OPS, seed)  # raises Mismatch on the first disagreement, AssertionError on a leak
    assert stats.ops >= OPS
    # The stream must have exercised the paths that matter, or the test proves little.
    final = stats.final_stats
    assert stats.refused_for_pages > 0, "no schedule ever ran out of pages"
    assert final["evictions"] > 0 and final["preemptions"] > 0 and final["prefix_hits_tokens"] > 0
    assert stats.errors > 0, "no call was refused: the stream never sent a bad id or count"
    for method in ("add_request", "schedule", "append_tokens", "reserve", "preempt", "finish"):
        assert stats.by_method.get(method, 0) > 0, method


def test_a_disagreement_is_reported() -> None:
    class Broken:
        def __init__(self, real: object) -> None:
            self.real = real

        def __getattr__(self, name: str) -> object:
            attr = getattr(self.real, name)
            if name == "budget":
                return lambda *a, **k: attr(*a, **k) + 1
            return attr

    driver = soak.Soak(0)
    driver.engines[1] = Broken(driver.engines[1])
    with pytest.raises(soak.Mismatch, match="budget"):
        for _ in range(5_000):
            driver.step()
