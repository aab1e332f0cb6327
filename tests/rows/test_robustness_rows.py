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
    """Rows bound (``swa`` windowed), request ``"r"`` in row 1 with 9 tokens scheduled."""
    cache.bind_rows(_tables(), offsets={"swa": np.zeros(4, np.int32)})
    cache.add_request("r", list(range(9)), row=1)
    assert cache.schedule("r", 9)
    cache.update_rows()


def bound(call: Any, kind: type[BaseException], names: str) -> Case:
    return Case(call, kind, names, setup=_bound)


CASES = {
    # add_request(row=)
    "row-negative": bound(lambda c: c.add_request("n", [1, 2], row=-1), ValueError, "row must be >= 0"),
    "row-bool": bound(lambda c: c.add_request("n", [1, 2], row=True), TypeError, "row"),
    "row-float": bound(lambda c: c.add_request("n", [1, 2], row=1.0), TypeError, "row"),
    "row-past-the-end": bound(lambda c: c.add_request("n", [1, 2], row=4), ValueError, "row must be < 4"),
    "row-held": bound(
        lambda c: c.add_request("n", [1, 2], row=1), ValueError, "row 1 is held by request 'r'"
    ),
    "row-unbound": Case(lambda c: c.add_request("n", [1, 2], row=0), ValueError, "bind_rows first"),
    "row-id-taken": bound(lambda c: c.add_request("r", [1, 2], row=0), ValueError, "already exists"),
    # update_rows
    "update-unbound": Case(lambda c: c.update_rows(), ValueError, "bind_rows first"),
    "update-full-int": bound(lambda c: c.update_rows(full=1), TypeError, "full must be a bool"),
    # schedule_rows / append_tokens_rows
    "schedule-rows-free-row": bound(
        lambda c: c.schedule_rows([0], [1]), ValueError, "row 0 holds no request"
    ),
    "schedule-rows-past-the-end": bound(
        lambda c: c.schedule_rows([9], [1]), ValueError, "row 9 holds no request"
    ),
    "schedule-rows-negative": bound(lambda c: c.schedule_rows([-1], [1]), ValueError, "rows[0]"),
    "schedule-rows-too-many": bound(lambda c: c.schedule_rows([1], [5]), ValueError, "asks for more tokens"),
    "schedule-rows-repeat": bound(
        lambda c: c.schedule_rows([1, 1], [0, 1]), ValueError, "asks for more tokens"
    ),
    "schedule-rows-lengths": bound(lambda c: c.schedule_rows([1, 1], [0]), ValueError, "but rows has 2"),
    "schedule-rows-unbound": Case(lambda c: c.schedule_rows([0], [1]), ValueError, "bind_rows first"),
    "append-rows-free-row": bound(
        lambda c: c.append_tokens_rows([2], [5]), ValueError, "row 2 holds no request"
    ),
    "append-rows-lengths": bound(lambda c: c.append_tokens_rows([1], [5, 6]), ValueError, "but rows has 1"),
    "append-rows-counts": bound(
        lambda c: c.append_tokens_rows([1], [5, 6], [3]), ValueError, "num_tokens adds up to 3"
    ),
    "append-rows-bad-token": bound(lambda c: c.append_tokens_rows([1], [-5]), ValueError, "token_ids[0]"),
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
    "bind-fewer-rows-than-held": bound(lambda c: c.bind_rows(_tables(rows=1)), ValueError, "holds row 1"),
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
            ["r"], out={**_tables(rows=1), "full": np.ma.masked_array(np.zeros((1, 8), np.int32))}
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
