"""What a simulator run reports: its result, the summary as a table or JSON, a plot, a progress bar."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

__all__ = ["ProgressBar", "SimulationResult", "format_summary", "percentiles", "plot_result", "summary_json"]


@dataclass
class SimulationResult:
    """The summary (JSON-ready) and per-step series of a run."""

    summary: dict[str, Any]
    step_cache_ns: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    pages_by_group: dict[str, list[int]] = field(default_factory=dict)
    group_ids: list[str] = field(default_factory=list)


def percentiles(values_ns: Sequence[int]) -> dict[str, float]:
    """Median, p99, mean and max of nanosecond timings, in microseconds (all 0 when empty)."""
    if not values_ns:
        return {"median_us": 0.0, "p99_us": 0.0, "mean_us": 0.0, "max_us": 0.0}
    array = np.asarray(values_ns, dtype=np.float64) / 1000.0
    return {
        "median_us": round(float(np.median(array)), 3),
        "p99_us": round(float(np.percentile(array, 99)), 3),
        "mean_us": round(float(array.mean()), 3),
        "max_us": round(float(array.max()), 3),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as an aligned table."""
    timing = summary["timing"]
    step, decode = timing["per_step"], timing["per_decode_step"]
    groups = ", ".join(
        f"{g['group_id']} ({g['kind']}, P={g['page_size']}"
        + (f", W={g['sliding_window']})" if g["sliding_window"] is not None else ")")
        for g in summary["groups"]
    )
    peak = ", ".join(f"{gid} {pages}" for gid, pages in summary["peak_pages_by_group"].items())
    calls = ", ".join(f"{kind} {ms:.1f}" for kind, ms in timing["by_call_ms"].items() if ms)
    rows = [
        (
            "engine",
            f"{summary['engine']} (eviction order {summary['eviction_order']}, freed uncached pages "
            + ("reused first" if summary["reuse_uncached_first"] else "appended")
            + (", pages registered when scheduled)" if summary.get("register_on_schedule") else ")"),
        ),
        ("model", f"{summary['model']}: {groups}"),
        (
            ("pool", f"{summary['num_pages']} pages (page 0 is the null page)")
            if summary.get("arena") is None
            else (
                "arena",
                f"{summary['arena']['units']} units of {summary['arena']['unit_bytes']} bytes; stranded "
                f"{summary['arena']['stranded_share_max']:.2%} at most, "
                f"{summary['arena']['stranded_share_mean']:.2%} on average; cached in busy units "
                f"{summary['arena']['cached_busy_share_max']:.2%} at most",
            )
        ),
        ("limits", f"{summary['max_scheduled_tokens']} tokens per step, {summary['max_running']} running"),
        ("requests", f"{summary['requests']}: {summary['finished']} finished, {summary['aborted']} aborted"),
        ("steps", str(summary["steps"])),
        ("preemptions", str(summary["preemptions"])),
        (
            "prefix hit rate",
            f"{summary['prefix_hit_rate']:.2%} ({summary['prefix_hits_tokens']} of "
            f"{summary['prefix_queries_tokens']} prompt tokens)",
        ),
        ("evictions", str(summary["evictions"])),
        *(
            [
                (
                    "checkpoints",
                    f"{summary['checkpoints']['written']} written, {summary['checkpoints']['hit']} hit, "
                    f"{summary['checkpoints']['evicted']} evicted",
                )
            ]
            if summary.get("checkpoints") is not None
            else []
        ),
        *(
            [
                (
                    "host tier",
                    f"{summary['host_pages']} pages: {summary['host_hits_tokens']} hit tokens from host, "
                    f"{summary['host_stores']} stores, {summary['host_loads']} loads, "
                    f"{summary['host_evictions']} host evictions",
                )
            ]
            if summary.get("host_pages")
            else []
        ),
        ("tokens", f"{summary['scheduled_tokens']} scheduled, {summary['generated_tokens']} generated"),
        ("peak running", str(summary["peak_running"])),
        ("peak pages", f"{peak} (together {summary['peak_pages_in_use']})"),
        ("cache time / step", f"median {step['median_us']:.1f} us, p99 {step['p99_us']:.1f} us"),
        (
            "  decode-only steps",
            f"median {decode['median_us']:.1f} us, p99 {decode['p99_us']:.1f} us ({decode['steps']} steps)",
        ),
        ("cache time total", f"{timing['cache_total_ms']:.1f} ms (by call, ms: {calls})"),
        ("wall time", f"{timing['wall_s']:.2f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def summary_json(summary: dict[str, Any]) -> str:
    """The summary as indented JSON."""
    return json.dumps(summary, indent=2)


def plot_result(result: SimulationResult, path: str | os.PathLike[str]) -> None:
    """Pages in use per group and running requests over the steps, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "plot_result needs matplotlib, the `plot` extra: pip install '.[plot]' in the "
            "flat-kvcache source tree"
        ) from exc
    summary = result.summary
    steps = np.arange(len(result.running))
    figure, (pages_axis, running_axis) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for gid in result.group_ids:
        pages_axis.plot(steps, result.pages_by_group[gid], label=gid, linewidth=1)
    if summary["num_pages"] is not None:
        pages_axis.axhline(summary["num_pages"] - 1, color="grey", linestyle="--", linewidth=1, label="pool")
    pages_axis.set_ylabel("pages in use")
    pages_axis.legend(loc="center right")
    pages_axis.set_title(
        f"{summary['model']}, {summary['engine']} engine, eviction order {summary['eviction_order']}: "
        f"{summary['requests']} requests, {summary['preemptions']} preemptions, "
        f"prefix hit rate {summary['prefix_hit_rate']:.1%}"
    )
    running_axis.plot(steps, result.running, color="black", linewidth=1)
    running_axis.set_ylabel("running requests")
    running_axis.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


class ProgressBar:
    """A one-line progress bar on a stream (stderr), redrawn at most every 0.1 s."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self._stream = stream
        self._width = width
        self._last = 0.0

    def __call__(self, step: int, done: int, total: int, running: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        filled = self._width * done // total if total else self._width
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r[{bar}] {done}/{total} requests, step {step}, {running} running ")
        if done >= total:
            self._stream.write("\n")
        self._stream.flush()
