"""Robustness of persistent rows and of bool arguments (the sweep's harness, both engines).

Every case is refused with the documented exception naming the argument (or the row, request
and group), leaves the cache as it was, and gets the same exception type and message from the
native engine and the pure-Python reference.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
from robustness_cases import Case, check_agree, check_case


def _tables(rows: int = 4, full: int = 8, swa: int = 3) -> dict[str, Any]:
    return {"full": np.zeros((rows, full), np.int32), "swa": np.zeros((rows, swa), np.int32)}


def _bound(cache: Any) -> None:
    """Rows bound (``swa`` windowed), request ``"r"`` in the lowest free slot (2: the busy
    cache's ``"a"`` and ``7`` hold slots 0 and 1) with 9 tokens scheduled."""
    cache.bind_rows(_tables(), offsets={"swa": np.zeros(4, np.int32)})
    assert cache.add_request("r", list(range(9))) == (2, 0)
    assert cache.schedule([2], [9]).tolist() == [True]
    cache.update_rows()


def _full(cache: Any) -> None:
    """Three rows bound and all three slots held (``"a"``, ``7``, then ``"r"`` in slot 2)."""
    cache.bind_rows(_tables(rows=3))
    assert cache.add_request("r", list(range(9))) == (2, 0)
    cache.update_rows()


def bound(call: Any, kind: type[BaseException], names: str) -> Case:
    return Case(call, kind, names, setup=_bound)


CASES = {
    # add_request / admit with rows bound
    "add-every-row-held": Case(
        lambda c: c.add_request("n", [1, 2]),
        ValueError,
        "add_request: all 3 slots of the bound rows are held (finish a request or bind more rows)",
        setup=_full,
    ),
    "add-id-taken": bound(
        lambda c: c.add_request("r", [1, 2]), ValueError, "add_request: request 'r' already exists"
    ),
    # update_rows
    "update-unbound": Case(lambda c: c.update_rows(), ValueError, "bind_rows first"),
    "update-full-int": bound(lambda c: c.update_rows(full=1), TypeError, "full must be a bool"),
    # slot-addressed calls with rows bound
    "schedule-free-slot": bound(
        lambda c: c.schedule([3], [1]), KeyError, "schedule: slot 3 holds no request"
    ),
    "schedule-past-the-rows": bound(
        lambda c: c.schedule([9], [1]), KeyError, "schedule: slot 9 holds no request"
    ),
    "schedule-negative": bound(lambda c: c.schedule([-1], [1]), ValueError, "slots[0]"),
    "schedule-too-many": bound(lambda c: c.schedule([2], [5]), ValueError, "asks for more tokens"),
    "schedule-repeat": bound(lambda c: c.schedule([2, 2], [0, 1]), ValueError, "asks for more tokens"),
    "schedule-lengths": bound(lambda c: c.schedule([2, 2], [0]), ValueError, "but slots has 2"),
    "append-free-slot": bound(
        lambda c: c.append_tokens([3], [5]), KeyError, "append_tokens: slot 3 holds no request"
    ),
    "append-lengths": bound(lambda c: c.append_tokens([2], [5, 6]), ValueError, "but slots has 1"),
    "append-counts": bound(
        lambda c: c.append_tokens([2], [5, 6], [3]), ValueError, "num_tokens adds up to 3"
    ),
    "append-bad-token": bound(lambda c: c.append_tokens([2], [-5]), ValueError, "token_ids[0]"),
    "finish-repeat": bound(lambda c: c.finish([2, 0, 2]), ValueError, "finish: slot 2 is listed twice"),
    "preempt-repeat": bound(lambda c: c.preempt([0, 0]), ValueError, "slot 0 is listed twice"),
    # bind_rows
    "bind-missing-group": Case(
        lambda c: c.bind_rows({"full": np.zeros((2, 4), np.int32)}),
        ValueError,
        "tables has no table for group 'swa'",
    ),
    "bind-unknown-group": Case(
        lambda c: c.bind_rows({**_tables(), "x": np.zeros((4, 2), np.int32)}), ValueError, "tables['x']"
    ),
    "bind-dtype": Case(
        lambda c: c.bind_rows({**_tables(), "full": np.zeros((4, 8), np.int64)}), TypeError, "tables['full']"
    ),
    "bind-1-d": Case(
        lambda c: c.bind_rows({**_tables(), "swa": np.zeros(4, np.int32)}), ValueError, "tables['swa']"
    ),
    "bind-row-counts": Case(
        lambda c: c.bind_rows({"full": np.zeros((4, 8), np.int32), "swa": np.zeros((3, 3), np.int32)}),
        ValueError,
        "every group needs the same rows",
    ),
    "bind-offsets-full": Case(
        lambda c: c.bind_rows(_tables(), offsets={"full": np.zeros(4, np.int32)}),
        ValueError,
        "offsets['full']: only sliding-window groups",
    ),
    "bind-offsets-unknown": Case(
        lambda c: c.bind_rows(_tables(), offsets={"x": np.zeros(4, np.int32)}),
        ValueError,
        "offsets has a buffer for 'x'",
    ),
    "bind-offsets-length": Case(
        lambda c: c.bind_rows(_tables(), offsets={"swa": np.zeros(3, np.int32)}), ValueError, "offsets['swa']"
    ),
    "bind-offsets-dtype": Case(
        lambda c: c.bind_rows(_tables(), offsets={"swa": np.zeros(4, np.int64)}), TypeError, "offsets['swa']"
    ),
    "bind-offsets-not-a-mapping": Case(lambda c: c.bind_rows(_tables(), offsets=[1]), TypeError, "offsets"),
    # The lowest slot without a row names its request: 7 in slot 1 (slot 2 is "r").
    "bind-fewer-rows-than-held": bound(
        lambda c: c.bind_rows(_tables(rows=1)),
        ValueError,
        "bind_rows: request 7 holds slot 1, but the new tables have 1 rows",
    ),
    "bind-fewer-rows-than-held-unbound": Case(
        lambda c: c.bind_rows(_tables(rows=1)),
        ValueError,
        "bind_rows: request 7 holds slot 1, but the new tables have 1 rows",
    ),
    # A masked buffer: the cache would write its data and ignore the mask.
    "bind-masked": Case(
        lambda c: c.bind_rows({**_tables(), "swa": np.ma.masked_array(np.zeros((4, 3), np.int32))}),
        TypeError,
        "tables['swa'] must not be a masked array",
    ),
    "bind-offsets-masked": Case(
        lambda c: c.bind_rows(_tables(), offsets={"swa": np.ma.masked_array(np.zeros(4, np.int32))}),
        TypeError,
        "offsets['swa'] must not be a masked array",
    ),
    "block-tables-out-masked": bound(
        lambda c: c.block_tables(
            [2], out={**_tables(rows=1), "full": np.ma.masked_array(np.zeros((1, 8), np.int32))}
        ),
        TypeError,
        "out['full'] must not be a masked array",
    ),
    # bool arguments: only a real bool
    "use_prefix_cache-int": Case(
        lambda c: c.add_request("n", [1, 2], use_prefix_cache=1), TypeError, "use_prefix_cache must be a bool"
    ),
    "use_prefix_cache-None": Case(
        lambda c: c.add_request("n", [1, 2], use_prefix_cache=None),
        TypeError,
        "use_prefix_cache must be a bool",
    ),
    "count_uncached-int": Case(
        lambda c: c.pages_reclaimable("p", 1, count_uncached=0),
        TypeError,
        "count_uncached must be a bool",
        page_level=True,
    ),
}
# A read-only buffer: built outside the lambda so the flag is really off.
_READONLY = np.zeros((4, 8), np.int32)
_READONLY.flags.writeable = False
CASES["bind-readonly"] = Case(
    lambda c: c.bind_rows({**_tables(), "full": _READONLY}), ValueError, "tables['full'] must be writable"
)

PARAMS = [pytest.param(case, id=name) for name, case in CASES.items()]


@pytest.mark.parametrize("case", PARAMS)
def test_refused(api: ModuleType, case: Case) -> None:
    check_case(api, case)


@pytest.mark.parametrize("case", PARAMS)
def test_same_error_on_both_engines(case: Case) -> None:
    check_agree(case)


@pytest.mark.parametrize("flag", ["enable_caching", "enable_kv_events", "reuse_uncached_first"])
@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_constructor_flags_take_only_bools(api: ModuleType, flag: str, value: object) -> None:
    specs = [api.KVCacheSpec("full", 4)]
    with pytest.raises(TypeError, match=f"{flag} must be a bool, got {type(value).__name__}"):
        api.FlatKVCache(specs, 8, **{flag: value})
    if flag != "enable_kv_events":
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            api.BlockPool(8, **{flag: value})
