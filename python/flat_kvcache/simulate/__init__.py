"""``flat-kvcache simulate``: a reference scheduler loop over a request trace (SPEC 9).

Its parts, one concern each:

- :mod:`flat_kvcache.simulate.trace`: the requests to run, built in or read from a JSONL or Mooncake file;
- :mod:`flat_kvcache.simulate.loop`: the scheduler loop that drives the cache step by step
  (its docstring describes one step) and times the cache calls;
- :mod:`flat_kvcache.simulate.report`: the run's result, its summary as a table or JSON, the
  plot and the progress bar;
- :mod:`flat_kvcache.simulate.decisions`: the digest of a loop's decisions, step by step, and the
  first step where two runs differ;
- :mod:`flat_kvcache.simulate.cluster`: the same loop on N engines in lockstep behind a router
  (``simulate --workers N``, docs/routing.md).

The command line (argument parsing, exit statuses) is :mod:`flat_kvcache.cli`; this package
takes plain values.
"""

from flat_kvcache.simulate.cluster import Admission, ClusterResult, simulate_cluster
from flat_kvcache.simulate.decisions import DecisionLog, Difference, first_difference, read_decisions
from flat_kvcache.simulate.loop import (
    CALL_KINDS,
    DEFAULT_MAX_RUNNING,
    DEFAULT_MAX_SCHEDULED_TOKENS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_POOL_FRACTION,
    DEFAULT_REUSE_UNCACHED_FIRST,
    DEFAULT_STATE_GRAIN,
    Engine,
    EvictionOrder,
    SimulationConfig,
    default_arena,
    default_num_pages,
    engine_specs,
    simulate,
    with_storage,
)
from flat_kvcache.simulate.report import (
    ProgressBar,
    SimulationResult,
    format_summary,
    plot_result,
    summary_json,
)
from flat_kvcache.simulate.trace import (
    DEFAULT_MS_PER_STEP,
    DEFAULT_NUM_REQUESTS,
    MOONCAKE_BLOCK_TOKENS,
    VOCAB,
    TokenArray,
    TraceRequest,
    default_trace,
    load_trace,
    mooncake_block,
)

__all__ = [
    "CALL_KINDS",
    "DEFAULT_MAX_RUNNING",
    "DEFAULT_MAX_SCHEDULED_TOKENS",
    "DEFAULT_MS_PER_STEP",
    "DEFAULT_NUM_REQUESTS",
    "DEFAULT_PAGE_SIZE",
    "DEFAULT_POOL_FRACTION",
    "DEFAULT_REUSE_UNCACHED_FIRST",
    "DEFAULT_STATE_GRAIN",
    "MOONCAKE_BLOCK_TOKENS",
    "VOCAB",
    "Admission",
    "ClusterResult",
    "DecisionLog",
    "Difference",
    "Engine",
    "EvictionOrder",
    "ProgressBar",
    "SimulationConfig",
    "SimulationResult",
    "TokenArray",
    "TraceRequest",
    "default_arena",
    "default_num_pages",
    "default_trace",
    "engine_specs",
    "first_difference",
    "format_summary",
    "load_trace",
    "mooncake_block",
    "plot_result",
    "read_decisions",
    "simulate",
    "simulate_cluster",
    "summary_json",
    "with_storage",
]
