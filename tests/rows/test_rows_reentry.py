"""Python code that runs when a bound buffer is released must be able to call the cache again.

``bind_rows`` and ``unbind_rows`` release the previously bound buffers. When that drops the last
reference, numpy deallocates the array and releases its base object, which can run Python code
(a ``weakref.finalize`` callback, a ``__del__``). docs/architecture.md promises that no lock is
held while Python code can run: a finalizer that calls every locking method of the cache must
find it usable, not hang the process.

A hang cannot be caught inside the process (the thread blocks holding the GIL), so each case
runs in a child interpreter with a timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys, weakref
    import numpy as np
    import flat_kvcache as fk
    from flat_kvcache import reference

    api = fk if sys.argv[1] == "native" else reference
    release = sys.argv[2]
    specs = fk.kv_cache_specs(
        fk.group_specs_from_layer_types(["sliding_attention", "full_attention"], 8, page_size=4)
    )
    cache = api.FlatKVCache(specs, num_pages=64)

    class Owner:
        # Exposes a buffer through the array interface: np.asarray makes an array whose base
        # is this object, so the object dies only when the bound array does.
        def __init__(self, shape):
            self.data = np.full(shape, 7, np.int32)
            self.__array_interface__ = self.data.__array_interface__

    def tables_of(rows, cols):
        owners = {g: Owner((rows, cols)) for g in cache.group_ids}
        return owners, {g: np.asarray(o) for g, o in owners.items()}

    calls = []

    def reenter():
        fresh = {g: np.full((2, 8), 7, np.int32) for g in cache.group_ids}
        for name, call in [
            ("update_rows", lambda: cache.update_rows()),
            ("slot_of", lambda: cache.slot_of("a")),
            ("id_of", lambda: cache.id_of(0)),
            ("schedule", lambda: cache.schedule([0], [0])),
            ("append_tokens", lambda: cache.append_tokens([0], [5])),
            ("schedule again", lambda: cache.schedule([0], [1])),
            ("reserve", lambda: cache.reserve([0], [2])),
            ("block_tables", lambda: cache.block_tables([0])),
            ("stats", lambda: cache.stats()),
            ("budget", lambda: cache.budget()),
            ("add_request", lambda: cache.add_request("b", list(range(9)))),
            ("finish", lambda: cache.finish([cache.slot_of("b")])),
            ("bind_rows", lambda: cache.bind_rows(fresh)),
            ("update_rows again", lambda: cache.update_rows(full=True)),
            ("unbind_rows", lambda: cache.unbind_rows()),
        ]:
            try:
                call()
                calls.append(name)
            except Exception as exc:
                calls.append(f"{name}: {type(exc).__name__}: {exc}")

    owners, tables = tables_of(2, 8)
    cache.bind_rows(tables)
    assert cache.add_request("a", list(range(10))) == (0, 0)
    assert cache.schedule([0], [10]).tolist() == [True]
    cache.update_rows()
    for owner in owners.values():
        weakref.finalize(owner, reenter)
    del owners, tables, owner
    if release == "rebind":
        cache.bind_rows({g: np.full((2, 8), 7, np.int32) for g in cache.group_ids})
    else:
        cache.unbind_rows()
    # One finalizer per group ran (the second one finds the rows unbound by the first).
    assert len(calls) == 15 * len(cache.group_ids), calls
    print("\\n".join(calls))
    cache.check_invariants()
    print("done")
    """
)


CALLS = [
    "update_rows",
    "slot_of",
    "id_of",
    "schedule",
    "append_tokens",
    "schedule again",
    "reserve",
    "block_tables",
    "stats",
    "budget",
    "add_request",
    "finish",
    "bind_rows",
    "update_rows again",
    "unbind_rows",
]


def run_child(engine: str, release: str) -> list[str]:
    """What the finalizers' calls returned, one line each, for ``engine``."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, engine, release],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{engine}: a finalizer calling the cache during {release} hung the process")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "done"
    return lines[:-1]


@pytest.mark.parametrize("release", ["rebind", "unbind"])
def test_finalizer_reenters_cache(release: str) -> None:
    native = run_child("native", release)
    assert native == run_child("reference", release)
    first = native[: len(CALLS)]
    if release == "rebind":
        # The new buffers are bound before the old ones are released: the first finalizer
        # finds the cache fully usable. (The second one runs after the first unbound the
        # rows, so its row calls are refused; it only has to return.)
        assert first == CALLS
    else:
        # The rows are unbound before the buffers are released: update_rows is refused, and
        # every slot-addressed call works (slots stay as they are after unbind_rows).
        unbound = "ValueError: update_rows: no rows are bound (call bind_rows first)"
        for call, line in zip(CALLS, first, strict=True):
            if call == "update_rows":
                assert line == f"{call}: {unbound}"
            else:
                assert line == call
