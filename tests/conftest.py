"""Shared test setup: hypothesis profiles and the two implementations under test.

The tests are in folders by concern (sizing, engine, requests, rows, host, events, torch,
model, cli, api, robustness); the modules they share are in ``support/`` (helpers, strategies,
machines, robustness_cases), which pyproject.toml puts on ``sys.path``. A test file imports
only those, never another test file.

``HYPOTHESIS_PROFILE`` selects the profile: ``dev`` (default, 100 examples) or ``ci``
(1000 examples). Native calls have no deadline in either (a debug build is slow to warm up).
"""

from __future__ import annotations

import os
from types import ModuleType

import flat_kvcache
import flat_kvcache.reference
import pytest
from hypothesis import settings

settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("ci", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

#: The two implementations of the same contract, as pytest parameters with readable ids.
IMPLEMENTATIONS = [
    pytest.param(flat_kvcache, id="native"),
    pytest.param(flat_kvcache.reference, id="reference"),
]


@pytest.fixture(params=IMPLEMENTATIONS)
def api(request: pytest.FixtureRequest) -> ModuleType:
    """The module under test: ``flat_kvcache`` (native) or ``flat_kvcache.reference``."""
    module: ModuleType = request.param
    return module


@pytest.fixture
def flat_api(api: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``api`` with the ``flat`` build flag on: the reference is switched on, native needs the build."""
    if api is flat_kvcache:
        if not flat_kvcache.FLAT_KVCACHE:
            pytest.skip("native module built without the `flat` feature")
    else:
        monkeypatch.setattr(flat_kvcache.reference.sizing, "_build_flag", lambda: True)
    return api
