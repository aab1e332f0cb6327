"""Name the first step where two runs' decision records differ (``flat_kvcache.simulate.decisions``).

    flat-kvcache simulate --decisions /tmp/a.jsonl ...
    flat-kvcache simulate --decisions /tmp/b.jsonl ...
    python benches/decisions_diff.py /tmp/a.jsonl /tmp/b.jsonl

Exit status 0 when every step decided the same, 1 (and the step, with both sides' values of each
field that differs) when not. ``benches/vllm_compare.py --decisions DIR`` writes ``DIR/flat.jsonl``
and ``DIR/vllm.jsonl``.
"""

from __future__ import annotations

from flat_kvcache.simulate.decisions import main

if __name__ == "__main__":
    raise SystemExit(main())
