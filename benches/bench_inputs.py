"""Cost of each integer input form at the Python boundary: the same 2,048-token prompt given as a
list of ints, a list of numpy integer scalars (what ``list(array)`` gives), a tuple, numpy arrays
of several dtypes (contiguous and strided) and a CPU torch tensor, through ``hash_pages`` and
through ``add_request`` + ``finish`` on a cache with prefix caching off (so every call hashes and
converts the whole prompt).

    python benches/bench_inputs.py            # table of ns per token and the ratio to a list of ints
    python benches/bench_inputs.py --smoke    # one quick round (CI)

Target: a list of numpy scalars within 3x of a list of ints.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable, Sequence
from typing import Any

import flat_kvcache as fk
import numpy as np

TOKENS = 2048
PAGE = 16


def forms(base: np.ndarray[Any, np.dtype[np.int64]]) -> dict[str, Any]:
    """The prompt in every form a user may have at hand (equal values in each)."""
    doubled = np.repeat(base, 2).astype(np.int32)
    made: dict[str, Any] = {
        "list of int": base.tolist(),
        "tuple of int": tuple(base.tolist()),
        "list of np.int64": list(base),
        "list of np.uint32": list(base.astype(np.uint32)),
        "ndarray int64": base.copy(),
        "ndarray uint32": base.astype(np.uint32),
        "ndarray int32 strided": doubled[::2],
        "ndarray int16 (values < 2**15)": (base % 30_000).astype(np.int16),
    }
    try:
        import torch

        made["torch int64 (CPU)"] = torch.from_numpy(base.copy())
    except ModuleNotFoundError:
        pass
    return made


def per_token_ns(fn: Callable[[], object], repeat: int, number: int) -> float:
    best = min(timeit.repeat(fn, repeat=repeat, number=number))
    return best / number / TOKENS * 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="one quick round (checks the script runs)")
    args = parser.parse_args(argv)
    repeat, number = (1, 1) if args.smoke else (7, 50)
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**15, size=TOKENS, dtype=np.int64)
    cache = fk.FlatKVCache([fk.KVCacheSpec("full", PAGE)], 8, enable_caching=False)

    def admit(prompt: Any) -> None:
        slot, _ = cache.add_request("r", prompt)
        cache.finish([slot])

    rows = []
    for name, prompt in forms(base).items():
        hashed = per_token_ns(lambda p=prompt: fk.hash_pages(p, PAGE), repeat, number)
        admitted = per_token_ns(lambda p=prompt: admit(p), repeat, number)
        rows.append((name, hashed, admitted))
    ref_hash, ref_admit = rows[0][1], rows[0][2]
    print(f"{TOKENS}-token prompt, ns per token (best of {repeat} x {number}); ratio to a list of ints")
    print(f"{'input form':<32} {'hash_pages':>12} {'ratio':>6} {'add_request':>12} {'ratio':>6}")
    for name, hashed, admitted in rows:
        ratios = hashed / ref_hash, admitted / ref_admit
        print(f"{name:<32} {hashed:>12.1f} {ratios[0]:>6.2f} {admitted:>12.1f} {ratios[1]:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
