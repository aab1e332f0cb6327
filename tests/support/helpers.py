"""Helpers shared by the tests (fixtures live in conftest.py).

- Optional dependencies: :func:`missing` (after a failed import) and :func:`need` (import one)
  skip the test outside CI and fail it in CI, the one rule for every optional dependency.
- Running the program: :func:`run_cli` in-process, :func:`run_python` in a fresh interpreter.
- Engines: :func:`normalize` turns results into comparable plain data; :func:`native_hybrid`
  builds the docs' running example on the native engine.
- Native-vs-reference cross-checks (sizing and memory properties): :class:`Outcome` /
  :func:`outcome`, :func:`assert_agree` and :func:`assert_exact` (their strategies are in
  strategies.py). The contract (docs/sizing-api.md): both implementations give the same
  result, or the same exception class and message. The one allowed difference is size: where a
  value, an intermediate or the result does not fit ``u64`` the native side raises
  ``OverflowError`` (naming the argument) and the reference returns the exact Python int.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import numpy as np
import pytest
from flat_kvcache import FlatKVCache, KVCacheSpec, PageCache
from flat_kvcache.cli import main
from strategies import I32_MAX, I32_MIN, U64_MAX

# --- optional dependencies --------------------------------------------------------------------


#: True where CI runs the tests (``.ci/run`` exports ``CI=true``, as CI services do): CI installs
#: every test dependency, so a missing one is an error there, never a skip.
IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def missing(name: str, exc: ImportError) -> NoReturn:
    """The one rule for an absent optional test dependency (torch, transformers, matplotlib,
    msgpack, msgspec, pyzmq): skip the test (or the module, at module level) that needs
    ``name``, except in CI (:data:`IN_CI`), where the test fails instead.

    At module level, for a typed import::

        try:
            import torch
        except ImportError as exc:
            missing("torch", exc)

    Inside a test, :func:`need` does the same in one call.
    """
    message = f"{name} is not installed (pip install -r requirements/test.txt): {exc}"
    if IN_CI:
        pytest.fail(f"{message}; CI must run every test", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need(name: str) -> ModuleType:
    """Import test dependency ``name``; see :func:`missing` for when it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(name, exc)


# --- running the program ----------------------------------------------------------------------

#: The repository root (README.md, benches/).
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``flat-kvcache ARGV...`` in this process: its exit status, stdout and stderr."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def run_python(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python ARGS...`` in a fresh interpreter (``-c CODE``, ``-m MODULE``), output captured."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False
    )


# --- engines ----------------------------------------------------------------------------------


def normalize(value: Any) -> Any:
    """Plain, comparable data from an engine result: PrefixMatch and arrays become tuples,
    dicts and sequences recurse."""
    if hasattr(value, "num_common_tokens"):
        return (
            "PrefixMatch",
            int(value.num_common_tokens),
            [list(map(int, pages)) for pages in value.pages],
            list(map(int, value.num_hit_pages)),
        )
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tolist())
    if isinstance(value, dict):
        return {key: normalize(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [normalize(item) for item in value]
    return value


#: The page-level protocol (docs/engine-api.md "PageCache"): the methods only ``PageCache`` has.
PAGE_LEVEL_METHODS = (
    "match_prefix",
    "claim",
    "acquire",
    "register",
    "reclaim",
    "free",
    "pages_reclaimable",
    "pages_consumed_by_claim",
    "prefill_first_chunk",
    "prefill_chunk",
    "decode_step",
)

HYBRID_SPECS = [KVCacheSpec("full", 4, group_id="full"), KVCacheSpec("sliding_window", 4, 8, "swa")]


def native_hybrid(num_pages: int = 64, **options: Any) -> FlatKVCache:
    """A native token-level cache with full P = 4 and sliding P = 4, W = 8 (the docs' running
    example)."""
    return FlatKVCache(HYBRID_SPECS, num_pages, **options)


def native_page_hybrid(num_pages: int = 64, **options: Any) -> PageCache:
    """:func:`native_hybrid` as a page-level cache."""
    return PageCache(HYBRID_SPECS, num_pages, **options)


# --- native-vs-reference cross-checks ---------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a call did: returned ``value``, or raised ``error`` with ``message``."""

    value: Any = None
    error: type[BaseException] | None = None
    message: str = ""

    def __str__(self) -> str:
        if self.error is None:
            return f"returned {self.value!r}"
        return f"raised {self.error.__name__}({self.message!r})"


def outcome(call: Callable[[], Any]) -> Outcome:
    """Run ``call`` and record its result or its (expected kind of) exception.

    Anything else (a ``PanicException``, an ``AttributeError``) propagates and fails the test.
    """
    try:
        return Outcome(value=call())
    except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
        return Outcome(error=type(exc), message=str(exc))


def ints_in(value: Any) -> list[int]:
    """Every int (not bool) inside ``value``: nested sequences, mappings and dataclasses."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ints_in([getattr(value, f.name) for f in dataclasses.fields(value)])
    if isinstance(value, Mapping):
        return ints_in(list(value.values()))
    if isinstance(value, list | tuple):
        return [v for item in value for v in ints_in(item)]
    return []


def fits_i32(*values: Any) -> bool:
    """True when every int inside ``values`` fits a signed 32-bit integer."""
    return all(I32_MIN <= v <= I32_MAX for v in ints_in(list(values)))


def assert_agree(native: Outcome, reference: Outcome, *, peak: int, names: Iterable[str] = ()) -> None:
    """Native and reference agree, up to the native ``u64`` limit.

    ``peak`` is the largest magnitude of the inputs and of the SPEC formula's intermediate values
    (computed by hand by the caller); native may raise ``OverflowError`` only when it exceeds
    ``u64``, and the message must name one of ``names``. When the reference's exact result holds
    an int above ``u64``, native must raise ``OverflowError``. A huge input that never reaches the
    result (a page size with no layers) may give either ``OverflowError`` or the reference's result.
    """
    context = f"native {native}, reference {reference}"
    if native.error is OverflowError:
        assert peak > U64_MAX, f"native overflowed although every value fits u64: {context}"
        names = list(names)
        assert any(name in native.message for name in names), (
            f"overflow message names none of {names}: {context}"
        )
        return
    if reference.error is None:
        too_big = [v for v in ints_in(reference.value) if v > U64_MAX]
        assert not too_big, f"native must raise OverflowError for {too_big[0]}: {context}"
    assert native == reference, context


def assert_exact(native: Outcome, ref: Outcome, *, computed: Iterable[int], names: Iterable[str]) -> None:
    """Native agrees with the reference exactly, up to the ``u64`` limit of what it computes.

    ``computed`` holds the values of the reference's result that are computed (counts, widths,
    bytes), as opposed to values it hands back unchanged. If the reference raised, native raised
    the same; if a computed value exceeds ``u64``, native raised ``OverflowError`` naming one of
    ``names``; otherwise native returned the reference's result (no overflow for any input size).
    """
    context = f"native {native}, reference {ref}"
    if ref.error is None:
        too_big = [v for v in computed if v > U64_MAX]
        if too_big:
            assert native.error is OverflowError, f"native must overflow for {too_big[0]}: {context}"
            names = list(names)
            assert any(name in native.message for name in names), f"names none of {names}: {context}"
            return
    assert native == ref, context


def publish(api: ModuleType, **kwargs: Any) -> Any:
    """``api.publish_paged_cache_groups`` on a small sliding + full model, with ``kwargs`` overriding.

    The defaults give (P=4, B=2, S=5, T=10, C=20; N=1, D=0, M=0): sliding W=8
    ``2*ceil(7/4) + ceil(5/4) + 2 + 0 + 1 = 9`` pages, full ``ceil(10/4) + 2 + 0 + 1 = 6``.
    """
    args: dict[str, Any] = {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window_tokens": 8,
        "page_size": 4,
        "max_live_requests": 2,
        "max_scheduled_tokens": 5,
        "max_total_tokens": 10,
        "max_context_len": 20,
    }
    args.update(kwargs)
    return api.publish_paged_cache_groups(**args)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run far faster (and steadier on a shared machine) on one torch thread.
    Autouse in a module that imports it (the model tests); a no-op without torch."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_arena_hybrid() -> Any:
    """The arena data tests' small hybrid ``ModelShape`` (needs torch): 2 full-attention + 2
    linear-attention layers, 768-byte K/V pages in 2,560-byte units, so some pages straddle two
    units (never handed out) and units hold 2 or 3 pages; bf16 K/V and conv state, fp32 ssm
    state (both NaN when filled with 0xFF bytes)."""
    import torch
    from flat_kvcache.torch import ModelShape

    return ModelShape(
        layer_types=("full_attention", "linear_attention", "full_attention", "linear_attention"),
        num_kv_heads=3,
        head_dim=8,
        kv_dtype=torch.bfloat16,
        state_shapes={"conv": (12, 3), "ssm": (4, 8, 7)},
        state_dtypes={"conv": torch.bfloat16, "ssm": torch.float32},
    )


#: ai21labs/Jamba-v0.1's config.json, trimmed to the fields the layout and the state read (the
#: mamba family tests and the arena figures of ``plan --memory``).
JAMBA_V01 = {
    "model_type": "jamba",
    "num_hidden_layers": 32,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
}
