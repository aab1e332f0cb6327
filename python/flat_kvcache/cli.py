"""The ``flat-kvcache`` command line.

Every command that takes a model takes it the same way: ``--config PATH`` for a Hugging Face
style ``config.json`` (or the folder that holds it), ``--preset NAME`` for a built-in preset
(``flat-kvcache plan --list-presets``); with neither, the default preset.

``flat-kvcache plan`` sizes the paged KV cache of a model: its page groups, the most pages each
group can hold (its worst case: these are per-group upper bounds on one shared pool, so they do
not add up; the plan also says what the pool needs for all of them at once), the block-table
widths and the hybrid slab pairing. With no arguments it plans the default preset. ``--json``
prints the same plan as JSON. ``--memory 80GiB`` (or ``--device cuda``, whose free memory sets
the budget) adds the memory plan (``--storage``): for a model with state layers the SPEC 13
arena (its unit, the pages each unit holds, and what requests of 16,384 tokens take of it and
how many fit); for an attention-only model, or with ``--storage equalized``, SPEC 3's equal
pages (bytes per page, pages, tokens that fit and the K/V slabs) and then the arena of the
same budget. It needs the ``torch`` extra, imported only then.

``flat-kvcache simulate`` runs a reference scheduler loop over a request trace (see
:mod:`flat_kvcache.simulate`), a model with state layers on the SPEC 13 arena unless
``--storage equalized`` asks for equal pages. ``flat-kvcache demo`` runs a tiny model on the cache
(:mod:`flat_kvcache.demo`).

Bad input is one line on stderr, ``flat-kvcache: error: ...``, naming the option, and a non-zero
exit status: 2 for an argument refused before any work starts (unknown option, negative size,
a ``--plot`` file that cannot be written, a pool too small for one token), 1 for a model the API
rejects (missing or invalid config, unknown preset or layer label), a ``--trace`` that cannot be
read, or a ``simulate`` run in which no request fits (every request aborted).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import flat_kvcache
from flat_kvcache import plan_arena, simulate
from flat_kvcache._types import STATE_LAYER_TYPES, ArenaPlan
from flat_kvcache.config import (
    group_specs_from_config,
    layer_types_from_config,
    load_model_config,
    max_context_len_from_config,
    sliding_window_from_config,
)
from flat_kvcache.errors import ConfigError, FlatKVCacheError
from flat_kvcache.families import read_model_layers
from flat_kvcache.presets import DEFAULT_PRESET, PRESETS, get_preset, preset_names

__all__ = ["build_plan", "format_plan", "main"]

PROG = "flat-kvcache"
#: Default ``--max-total-tokens``: room for this many tokens, or one request at full context.
DEFAULT_MAX_TOTAL_TOKENS = 262144


class _Exit(Exception):
    """Raised instead of ``sys.exit`` inside argparse, so :func:`main` can return the status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, ``flat-kvcache: error: ...`` (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        _print_error(message)
        raise _Exit(2)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


def _print_error(message: str) -> None:
    """Print ``message`` as one ``flat-kvcache: error:`` line on stderr."""
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)


def _extra(name: str) -> str:
    """How to install optional extra ``name``, as the README does (from the source tree)."""
    return f"the `{name}` extra: pip install '.[{name}]' in the flat-kvcache source tree"


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--config PATH`` or ``--preset NAME`` (one of them), the same on every command."""
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--config", metavar="PATH", help="a Hugging Face style config.json, or the folder that holds it"
    )
    model.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a built-in model preset (default {DEFAULT_PRESET}; presets: {', '.join(preset_names())})",
    )


def _load_model(args: argparse.Namespace) -> tuple[dict[str, Any], str, str]:
    """The model config of ``--config`` / ``--preset``, what it is called in the output
    (``preset NAME`` or the path) and the option that gave it (for messages).

    Raises ValueError, naming the option, for a missing file, invalid JSON or an unknown preset.
    """
    if args.config is not None:
        option = f"--config {args.config}"
        path = Path(args.config)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            what = "the folder has no config.json" if path.is_dir() else "no such file"
            hint = "; a built-in preset goes with --preset" if args.config in PRESETS else ""
            raise ValueError(f"{option}: {what}{hint}")
        try:
            return load_model_config(file), args.config, option
        except OSError as exc:
            raise ValueError(f"{option}: {exc.strerror or exc}") from None
        except ValueError as exc:
            # The message starts with the path the option already names.
            raise ValueError(f"{option}: {str(exc).removeprefix(f'{file}: ')}") from None
    name = DEFAULT_PRESET if args.preset is None else args.preset
    option = f"--preset {name}"
    if name not in PRESETS:
        hint = "; a config.json goes with --config" if name.endswith(".json") or os.sep in name else ""
        raise ValueError(f"{option}: unknown preset; known presets: {', '.join(preset_names())}{hint}")
    return get_preset(name), f"preset {name}", option


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` that accepts an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _positive_float(text: str) -> float:
    """An argparse ``type`` that accepts a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    """An argparse ``type`` that accepts a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BYTE_UNITS.update({f"{p}{s}": 1 << (10 * (i + 1)) for i, p in enumerate("kmgt") for s in ("", "ib")})


def _byte_size(text: str) -> int:
    """An argparse ``type`` for a byte count: ``80GiB``, ``512M`` (binary), ``1.5GB`` (decimal), ``1000``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB, 512MiB or 1000, got {text!r}")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def _utilization(text: str) -> float:
    """An argparse ``type`` for a fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="Size the paged KV cache of a hybrid-attention model (flat per-group layout).",
        epilog="With no command, 'plan' runs (on the default preset when no model is given).",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {flat_kvcache.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="page groups, page counts, block-table widths and slab pairing of a model",
        description=(
            "Print the page groups of a model (id, retention, window, family); the most pages each "
            "group can hold (its worst case under the sizes below: per-group upper bounds on one "
            "shared pool, which do not add up) and the pool that holds every group's worst case at "
            "once; the columns of each group's block table (and of a windowed sliding table); and "
            "the hybrid slab group size."
        ),
    )
    _add_model_options(plan)
    plan.add_argument(
        "--list-presets", action="store_true", help="list the presets (with --json: as JSON) and exit"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    sizes = plan.add_argument_group("sizes")
    non_negative, positive = _int_at_least(0), _int_at_least(1)
    sizes.add_argument("--page-size", type=positive, default=16, metavar="P", help="tokens per page (16)")
    sizes.add_argument(
        "--max-live-requests", type=non_negative, default=256, metavar="B", help="max live requests (256)"
    )
    sizes.add_argument(
        "--max-scheduled-tokens",
        type=non_negative,
        default=8192,
        metavar="S",
        help="max tokens scheduled per step (8192)",
    )
    sizes.add_argument(
        "--max-total-tokens",
        type=non_negative,
        metavar="T",
        help=f"max tokens held by all requests (default: max({DEFAULT_MAX_TOTAL_TOKENS}, max context); "
        "with --memory, the most for which every group's worst case fits in the pool at once)",
    )
    sizes.add_argument(
        "--max-context-len",
        type=non_negative,
        metavar="C",
        help="max context length (default: the config's max_position_embeddings, else 131072)",
    )
    sizes.add_argument(
        "--decode-input-tokens",
        type=positive,
        default=1,
        metavar="N",
        help="decode input tokens per request per step, >1 with speculative decoding (1)",
    )
    sizes.add_argument(
        "--overlap-schedule-depth",
        type=int,
        choices=(0, 1),
        default=0,
        metavar="D",
        help="overlap schedule depth, 0 or 1 (0)",
    )
    sizes.add_argument(
        "--safety-margin", type=non_negative, default=0, metavar="M", help="extra pages per group (0)"
    )
    memory = plan.add_argument_group(f"memory (needs {_extra('torch')})")
    memory.add_argument(
        "--memory",
        type=_byte_size,
        metavar="SIZE",
        help="KV-cache memory budget, e.g. 80GiB: adds the storage that budget buys (see --storage): "
        "the arena's units and what requests of 16,384 tokens take of it, or the pool's pages, the "
        "tokens that fit with every group at its worst case (the default T) and the K/V slab layout",
    )
    memory.add_argument(
        "--storage",
        choices=STORAGES,
        help="how the budget is laid out. arena: the SPEC 13 arena (FlatKVCache(arena=)), 16-token "
        "attention pages and a state slot per unit, the default for a model with state layers; "
        "equalized: SPEC 3's one pool of equal pages, each page id a row in every layer's buffer "
        "and the page raised until it holds a recurrent state (the layout vLLM-style storage "
        "uses), the default for an attention-only model (with the arena of the same budget after it)",
    )
    memory.add_argument(
        "--device",
        metavar="DEVICE",
        help="the device to plan for, e.g. cuda:0; without --memory its free memory sets the budget",
    )
    memory.add_argument(
        "--utilization",
        type=_utilization,
        default=0.9,
        metavar="U",
        help="fraction of the device's memory to use: budget = free - total * (1 - U) (0.9)",
    )
    memory.add_argument("--kv-dtype", metavar="DTYPE", help="K/V dtype, e.g. fp8_e4m3 (default: the model's)")
    plan.set_defaults(run=_run_plan)
    _add_simulate_parser(commands)
    demo = commands.add_parser(
        "demo",
        add_help=False,
        help="generate tokens with a tiny random model through the cache and show each step "
        "(needs the model extra; 'demo --help' for its options)",
    )
    # Listed here for --help; main() hands its arguments to the demo's own parser.
    demo.set_defaults(run=lambda _args: _run_demo([]))
    return parser


def _run_demo(argv: list[str]) -> int:
    """``flat-kvcache demo ...``: the options are the demo's own (``flat_kvcache.demo``)."""
    from flat_kvcache import demo

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            status = demo.main(argv)
    except SystemExit as exc:  # argparse's --help and usage errors inside the demo
        code = exc.code if isinstance(exc.code, int) else 2
        if code:
            # argparse printed its usage and then "prog: error: ..."; keep the one error line.
            lines = [line for line in errors.getvalue().splitlines() if ": error: " in line]
            _print_error(lines[-1].split(": error: ", 1)[1] if lines else errors.getvalue())
        else:
            sys.stderr.write(errors.getvalue())
        return code
    sys.stderr.write(errors.getvalue())
    return status


def _with_default_command(argv: list[str]) -> list[str]:
    """Insert ``plan`` when the command line starts with an option (top-level help and version aside)."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        return ["plan", *argv]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (``argv`` defaults to ``sys.argv[1:]``) and return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["demo"]:
        return _run_demo(args_list[1:])
    try:
        args = _parser().parse_args(_with_default_command(args_list))
    except _Exit as exc:
        return exc.status
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (`flat-kvcache plan | head`): stop quietly, and keep Python's
        # final flush of stdout from failing again (the recipe in the `signal` module docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# --- simulate ---------------------------------------------------------------------------------


def _add_simulate_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` subcommand to ``commands`` (an argparse subparsers object)."""
    non_negative, positive = _int_at_least(0), _int_at_least(1)
    parser: argparse.ArgumentParser = commands.add_parser(
        "simulate",
        help="run a reference scheduler loop over a request trace and time the cache calls",
        description=(
            "Run a reference scheduler loop (FCFS, chunked prefill under a token budget, decode, "
            "admission and preemption per SPEC 9) over a request trace, and print steps, finished "
            "requests, preemptions, prefix hit rate, peak pages per group and the time spent in "
            "cache calls per step. The default trace is built in: 2000 requests, prompts of 512 "
            "to 4096 tokens, half sharing a 1024-token prefix, 128 generated tokens each."
        ),
    )
    _add_model_options(parser)
    parser.add_argument(
        "--trace",
        metavar="FILE.jsonl",
        help="a JSONL or Mooncake trace, told apart by the first line's keys (default: the built-in one)",
    )
    parser.add_argument(
        "--max-requests",
        type=positive,
        metavar="N",
        help="run only the first N requests of the trace (default: all)",
    )
    parser.add_argument(
        "--ms-per-step",
        type=_positive_float,
        default=simulate.DEFAULT_MS_PER_STEP,
        metavar="MS",
        help=f"a Mooncake trace's request arrives at step timestamp / MS ({simulate.DEFAULT_MS_PER_STEP:g})",
    )
    parser.add_argument(
        "--num-requests",
        type=non_negative,
        default=simulate.DEFAULT_NUM_REQUESTS,
        metavar="N",
        help=f"requests in the built-in trace ({simulate.DEFAULT_NUM_REQUESTS})",
    )
    parser.add_argument(
        "--seed", type=non_negative, default=0, metavar="S", help="seed of every token id (0)"
    )
    parser.add_argument(
        "--num-pages",
        type=positive,
        metavar="N",
        help="with equalized storage, the pool's equal pages, page 0 included (default: half of "
        "what the first --max-running requests need at full length, so the run preempts)",
    )
    parser.add_argument(
        "--page-size",
        type=positive,
        default=simulate.DEFAULT_PAGE_SIZE,
        metavar="P",
        help="tokens per page (16)",
    )
    parser.add_argument(
        "--max-scheduled-tokens",
        type=positive,
        default=simulate.DEFAULT_MAX_SCHEDULED_TOKENS,
        metavar="S",
        help=f"token budget per step ({simulate.DEFAULT_MAX_SCHEDULED_TOKENS})",
    )
    parser.add_argument(
        "--max-running",
        type=positive,
        default=simulate.DEFAULT_MAX_RUNNING,
        metavar="B",
        help=f"most requests running at once ({simulate.DEFAULT_MAX_RUNNING})",
    )
    parser.add_argument(
        "--engine",
        choices=("native", "reference"),
        default="native",
        help="the Rust engine (default) or the pure-Python reference",
    )
    parser.add_argument(
        "--eviction-order",
        choices=("hybrid", "group"),
        default="hybrid",
        help="free-list order of a finished request's pages: all groups tail first (hybrid, "
        "default) or group by group (group, the reference design's)",
    )
    parser.add_argument(
        "--eviction-policy",
        choices=("lru", "reuse"),
        default="lru",
        help="the state checkpoint policy (SPEC 13.8): both keep every checkpoint until evicted; "
        "reuse adds the body's end on the sharing grain learned from the prompts seen and whole "
        "hybrid prefixes (lru, default)",
    )
    parser.add_argument(
        "--reuse-uncached-first",
        action=argparse.BooleanOptionalAction,
        default=simulate.DEFAULT_REUSE_UNCACHED_FIRST,
        help="a freed page that holds no key joins the front of the free list, so it is reused "
        "before any cached page (--no-reuse-uncached-first: the back, SPEC 5's order; default "
        + ("on" if simulate.DEFAULT_REUSE_UNCACHED_FIRST else "off")
        + ")",
    )
    parser.add_argument(
        "--register-on-schedule",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="same-step sharing: schedule registers the full pages of the chunk it takes, so a "
        "request admitted later in the same step hits them, as vLLM's scheduler does (attention "
        "groups; ignored with state groups; default off)",
    )
    parser.add_argument(
        "--host-pages",
        type=_int_at_least(0),
        default=0,
        metavar="N",
        help="add a host-memory tier of N pages, N per group with --arena (write-through; "
        "transfers acknowledged at once; default 0, none)",
    )
    storage = parser.add_argument_group(f"storage (the arena needs {_extra('torch')})")
    storage.add_argument(
        "--storage",
        choices=STORAGES,
        help="arena: the SPEC 13 arena (FlatKVCache(arena=)), the default for a model with state "
        "layers, sized by --arena or, by default, to half of the units the first --max-running "
        "requests take at full length (a working state slot each, their attention pages packed "
        "into units), at least the largest request alone, as --num-pages is by default; "
        "equalized: --num-pages equal pages, each page id a row in every layer's buffer (SPEC 3, "
        "the layout vLLM-style storage uses; the simulator counts pages, so a page is --page-size "
        "tokens), the default for an attention-only model",
    )
    storage.add_argument(
        "--arena",
        type=_byte_size,
        metavar="SIZE",
        help="lay the pages out in a SPEC 13 arena of SIZE bytes (e.g. 40GiB; plan_arena over the "
        "model's K/V and state at bf16 / fp32) instead of --num-pages equal pages; the summary adds "
        "the stranded memory and the state checkpoints",
    )
    storage.add_argument(
        "--state-grain",
        type=positive,
        metavar="G",
        help="state groups' page size in tokens: their checkpoint grain (default on the arena: the "
        "least multiple of 64 and --page-size; on equal pages: the page size)",
    )
    cluster = parser.add_argument_group("many engines behind a router (docs/routing.md)")
    cluster.add_argument(
        "--workers",
        type=positive,
        default=1,
        metavar="N",
        help="replay the trace over N engines in lockstep, each with 1/N of --num-pages or --arena "
        "(default 1: one engine)",
    )
    cluster.add_argument(
        "--router",
        choices=("round-robin", "kv"),
        help="how requests are spread over the workers: round-robin (the default), or kv: to the "
        "best prefix hit predicted by Dynamo's radix indexer from every worker's KV events (needs "
        f"{_extra('dynamo')}; models with one full-attention group and at most one state group)",
    )
    cluster.add_argument(
        "--kv-overlap-weight",
        type=_non_negative_float,
        metavar="W",
        help="with --router kv: route by Dynamo's router cost, W x the prompt blocks a worker would "
        "prefill + the blocks of the requests it holds (cheapest wins), instead of the best hit "
        "first with load only on ties (Dynamo's default W is 1.0)",
    )
    cluster.add_argument(
        "--worker-memory",
        metavar="SIZE",
        help="each worker's memory instead of 1/N: pages, or bytes (e.g. 20GiB) with --arena",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="run with prefix caching off")
    parser.add_argument("--no-block-tables", action="store_true", help="skip the per-step block_tables call")
    parser.add_argument(
        "--tables",
        choices=("rows", "full"),
        default="rows",
        help="rows (default): persistent block-table rows updated by what changed (bind_rows once, "
        "update_rows every step; row s is slot s); full: a full block_tables(slots, out=) rewrite "
        "every step",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument(
        "--decisions",
        metavar="FILE.jsonl",
        help="write each step's decisions (requests scheduled with their tokens, admitted with their "
        "hit, finished, preempted, aborted) to FILE as one JSON line; the summary's decisions digest "
        "folds them (benches/decisions_diff.py A.jsonl B.jsonl names the first step where two runs "
        "differ)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw pages in use per group and running requests per step into FILE (png, pdf, svg...; "
        f"its folder must exist; needs {_extra('plot')})",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="show the progress bar even when stderr is not a terminal",
    )
    parser.set_defaults(run=_run_simulate)
    return parser


def _run_simulate(args: argparse.Namespace) -> int:
    """Run ``flat-kvcache simulate`` from parsed arguments; returns the exit status."""
    if args.plot is not None:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            _print_error(f"--plot needs matplotlib, {_extra('plot')}")
            return 1
        problem = _plot_problem(args.plot, FigureCanvasBase.get_supported_filetypes())
        if problem is not None:
            _print_error(f"--plot {args.plot}: {problem}")
            return 2
    try:
        cfg, _, option = _load_model(args)
        try:
            groups = group_specs_from_config(cfg, page_size=args.page_size)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    except ValueError as exc:
        _print_error(str(exc))
        return 1
    if args.arena is not None and args.num_pages is not None:
        # --host-pages N with --arena is a host tier of N pages per group (each of its own geometry).
        _print_error("--arena sizes the pool itself: it cannot be combined with --num-pages")
        return 2
    if args.storage == "equalized" and args.arena is not None:
        _print_error(
            "--storage equalized runs on --num-pages equal pages: it cannot be combined with --arena"
        )
        return 2
    if args.storage == "arena" and args.num_pages is not None:
        _print_error(
            "--storage arena sizes the pool in units (--arena): it cannot be combined with --num-pages"
        )
        return 2
    has_state = any(group.family == "state" for group in groups)
    if args.num_pages is not None and has_state and args.storage is None:
        _print_error(
            f"--num-pages {args.num_pages}: a model with state layers runs on the SPEC 13 arena by "
            "default, sized by --arena; add --storage equalized to run it on --num-pages equal pages "
            "(the layout vLLM-style storage uses)"
        )
        return 2
    if args.num_pages is not None and args.num_pages < len(groups) + 1:
        _print_error(
            f"--num-pages {args.num_pages} is too small: one token of a request needs a page in each "
            f"of the model's {len(groups)} groups besides the null page 0, so --num-pages must be "
            f">= {len(groups) + 1}"
        )
        return 2
    try:
        arena = None if args.arena is None else _simulate_arena(cfg, args)
        trace = _simulate_trace(args)
        config = simulate.SimulationConfig(
            model=(args.preset or DEFAULT_PRESET) if args.config is None else Path(args.config),
            engine=args.engine,
            eviction_order=args.eviction_order,
            eviction_policy=args.eviction_policy,
            reuse_uncached_first=args.reuse_uncached_first,
            register_on_schedule=args.register_on_schedule,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_scheduled_tokens=args.max_scheduled_tokens,
            max_running=args.max_running,
            enable_caching=not args.no_prefix_caching,
            block_tables=not args.no_block_tables,
            tables=args.tables,
            host_pages=args.host_pages,
            arena=arena,
            state_page_size=args.state_grain,
            storage=args.storage,
        )
        show = args.progress or sys.stderr.isatty()
        if args.kv_overlap_weight is not None and args.router != "kv":
            raise ValueError("--kv-overlap-weight is a setting of --router kv: add --router kv")
        if args.workers > 1 or args.router is not None or args.worker_memory is not None:
            if args.decisions is not None:
                raise ValueError(
                    "--decisions records one engine's loop: it cannot be combined with --workers"
                )
            return _run_cluster(args, cfg, trace, config, show)
        progress = simulate.ProgressBar(sys.stderr) if show and trace else None
        if args.decisions is None:
            result = simulate.simulate(trace, config, progress=progress)
        else:
            with open(args.decisions, "w", encoding="utf-8") as decisions:
                result = simulate.simulate(trace, config, progress=progress, decisions=decisions)
    except (OSError, ValueError, OverflowError, ConfigError) as exc:
        _print_error(_option_names(str(exc), _SIMULATE_OPTIONS))
        return 1
    summary = result.summary
    if summary["finished"] == 0 and summary["aborted"] > 0 and summary["arena"] is not None:
        what = f"--arena {args.arena}" if args.arena is not None else "the default arena"
        _print_error(
            f"{what}: no request finished; all {summary['aborted']} were aborted because none fits the "
            f"arena's {summary['arena']['units']} units of {summary['arena']['unit_bytes']} bytes "
            "alone; give a larger --arena"
        )
        return 1
    if summary["finished"] == 0 and summary["aborted"] > 0:
        # Every request was aborted as out of memory: the run measured nothing.
        _print_error(
            f"--num-pages {summary['num_pages']}: no request finished; all {summary['aborted']} were "
            f"aborted because none fits the {summary['num_pages'] - 1} usable pages alone (a prompt "
            "is admitted whole); give a larger --num-pages or leave it out (the default fits the "
            "largest request)"
        )
        return 1
    if args.plot is not None:
        try:
            simulate.plot_result(result, args.plot)
        except OSError as exc:  # the folder was checked; the disk may still fill up
            _print_error(f"--plot {args.plot}: {exc.strerror or exc}")
            return 1
    print(simulate.summary_json(summary) if args.json else simulate.format_summary(summary))
    return 0


def _run_cluster(
    args: argparse.Namespace,
    cfg: dict[str, Any],
    trace: list[simulate.TraceRequest],
    config: simulate.SimulationConfig,
    show: bool,
) -> int:
    """``simulate --workers N``: ``config`` split per worker, then ``simulate_cluster``."""
    router = args.router or "round-robin"
    if args.engine != "native":
        raise ValueError("--workers: a cluster runs the native engine only (leave out --engine)")
    if args.plot is not None:
        raise ValueError("--plot draws one engine's run: it cannot be combined with --workers")
    if router == "kv" and args.host_pages:
        raise ValueError("--router kv does not model a host-memory tier: leave out --host-pages")
    workers = args.workers
    if config.arena is not None or (config.storage or default_storage(cfg)) == "arena":
        per_worker: int | None = None
        if args.worker_memory is not None:
            try:
                per_worker = _byte_size(args.worker_memory)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"--worker-memory: {exc}") from None
        elif args.arena is not None:
            per_worker = args.arena // workers
        if per_worker is not None:  # else 1/N of the default arena (simulate_cluster)
            arena = _simulate_arena(cfg, argparse.Namespace(**{**vars(args), "arena": per_worker}))
            config = dataclasses.replace(config, arena=arena)
    else:
        pages: int | None = None
        if args.worker_memory is not None:
            try:
                pages = int(args.worker_memory)
            except ValueError:
                pages = 0
            if pages < 2:
                raise ValueError(
                    f"--worker-memory {args.worker_memory}: without --arena it is each worker's page "
                    "count, an integer >= 2"
                )
        elif args.num_pages is not None:
            pages = 1 + math.ceil((args.num_pages - 1) / workers)
        config = dataclasses.replace(config, num_pages=pages)
    try:
        result = simulate.simulate_cluster(
            trace,
            config,
            workers=workers,
            router=router,
            overlap_weight=args.kv_overlap_weight,
            progress=simulate.ProgressBar(sys.stderr) if show and trace else None,
        )
    except ImportError as exc:
        raise ValueError(f"--router kv: {exc}") from None
    summary = result.summary
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        width = max(len(key) for key in summary)
        print("\n".join(f"{key:<{width}}  {value}" for key, value in summary.items()))
    return 0


def _plot_problem(path: str, formats: Mapping[str, str]) -> str | None:
    """Why ``--plot path`` cannot be written, or None: checked before the run. ``formats`` are the
    file name extensions matplotlib writes."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return "is a folder; give a file name such as pages.png"
    if not folder.is_dir():
        return f"no such folder: {folder}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot write to the folder {folder}"
    if target.suffix.lower().removeprefix(".") not in formats:
        return "the file name must end in an image format matplotlib writes, such as .png, .pdf or .svg"
    return None


#: The option of each :class:`~flat_kvcache.simulate.SimulationConfig` field a message may name.
_SIMULATE_OPTIONS = {
    "num_pages": "--num-pages",
    "max_scheduled_tokens": "--max-scheduled-tokens",
    "max_running": "--max-running",
    "page_size": "--page-size",
}


def _simulate_trace(args: argparse.Namespace) -> list[simulate.TraceRequest]:
    """The trace of ``flat-kvcache simulate``: ``--trace`` read (errors naming the option) or
    the built-in one."""
    if args.trace is None:
        trace = simulate.default_trace(args.num_requests, seed=args.seed)
        return trace if args.max_requests is None else trace[: args.max_requests]
    try:
        return simulate.load_trace(
            args.trace, seed=args.seed, max_requests=args.max_requests, ms_per_step=args.ms_per_step
        )
    except OSError as exc:
        raise ValueError(f"--trace {args.trace}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--trace: {exc}") from None


# --- plan -------------------------------------------------------------------------------------


def _run_plan(args: argparse.Namespace) -> int:
    if args.list_presets:
        _print_presets(as_json=args.json)
        return 0
    with_memory = args.memory is not None or args.device is not None
    for name, value in (("--kv-dtype", args.kv_dtype), ("--storage", args.storage)):
        if value is not None and not with_memory:
            _print_error(f"{name} needs --memory or --device")
            return 2
    option = ""
    try:
        cfg, source, option = _load_model(args)
        memory: dict[str, Any] | None = None
        if with_memory:
            storage = args.storage or default_storage(cfg)
            memory = _arena_plan_memory(cfg, args) if storage == "arena" else _memory_plan(cfg, args)
        # Equalized pages: a state layer may raise the page size; their pool bounds the counts.
        equalized = memory if memory is not None and memory["storage"] == "equalized" else None
        plan = build_plan(
            cfg,
            source=source,
            page_size=args.page_size if equalized is None else equalized["page_size"],
            max_live_requests=args.max_live_requests,
            max_scheduled_tokens=args.max_scheduled_tokens,
            max_total_tokens=args.max_total_tokens,
            max_context_len=args.max_context_len,
            decode_input_tokens=args.decode_input_tokens,
            overlap_schedule_depth=args.overlap_schedule_depth,
            safety_margin=args.safety_margin,
            num_pages=None if equalized is None else equalized["num_pages"],
        )
    except (OSError, ValueError, OverflowError, ConfigError) as exc:
        message = _option_names(str(exc))
        # A config the sizing rejects: say which option gave it.
        _print_error(f"{option}: {message}" if message.startswith("config ") else message)
        return 1
    if memory is not None and equalized is not None:
        # The arena of the same budget, after the equalized pages.
        try:
            memory["arena"] = _arena_memory(
                cfg, args, _budget_arena(cfg, args, memory["budget_bytes"] - memory["allocator_slack_bytes"])
            )
        except ConfigError as exc:
            _print_error(_option_names(str(exc)))
            return 1
    if memory is not None:
        plan["memory"] = memory
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


#: Python keywords of the plan API and the command-line options that set them.
_OPTION_OF_KEYWORD = {
    "budget_bytes": "--memory",
    "kv_dtype": "--kv-dtype",
    "page_size": "--page-size",
    "max_live_requests": "--max-live-requests",
    "max_scheduled_tokens": "--max-scheduled-tokens",
    "max_total_tokens": "--max-total-tokens",
    "max_context_len": "--max-context-len",
    "decode_input_tokens": "--decode-input-tokens",
    "overlap_schedule_depth": "--overlap-schedule-depth",
    "safety_margin": "--safety-margin",
    "utilization": "--utilization",
}


def _option_names(message: str, options: dict[str, str] | None = None) -> str:
    """``message`` with each Python keyword of the API (``budget_bytes=``; ``options`` maps
    them, the plan's by default) replaced by the option that sets it (``--memory``), so an
    error names what the user typed."""
    names = _OPTION_OF_KEYWORD if options is None else options
    pattern = r"\b(" + "|".join(names) + r")\b(=(?=\S))?"
    return re.sub(pattern, lambda m: names[m.group(1)] + (" " if m.group(2) else ""), message)


#: The storages of ``plan --storage`` and ``simulate --storage``: the SPEC 13 arena, or SPEC 3's
#: one pool of equal pages (each page id a row in every layer's buffer; vLLM-style storage).
STORAGES = ("arena", "equalized")


def default_storage(cfg: Mapping[str, Any]) -> str:
    """The storage a model gets unless asked otherwise: the SPEC 13 arena for a model with state
    layers (its equalized page would be raised until it holds a whole recurrent state), the
    equalized pages for an attention-only model (nothing to raise there)."""
    return "arena" if read_model_layers(cfg).state_kind is not None else "equalized"


def _simulate_arena(cfg: dict[str, Any], args: argparse.Namespace) -> Any:
    """The ``ArenaPlan`` of ``simulate --arena``: ``plan_arena`` over the model's components
    (K/V at the model's dtype, state at ``ModelShape``'s defaults) for ``--arena`` bytes.

    torch is imported here, only when asked for: it is an optional extra."""
    try:
        from flat_kvcache.torch import ModelShape
    except ImportError:
        raise ValueError(f"--arena: the arena plan needs PyTorch, {_extra('torch')}") from None
    try:
        shape = ModelShape.from_config(cfg)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    try:
        return plan_arena(shape.components(), args.page_size, args.arena)
    except ValueError as exc:
        raise ValueError(f"--arena {args.arena}: {exc}") from None


#: The request ``plan --memory`` sizes the arena's padding and tokens that fit for.
ARENA_REFERENCE_TOKENS = 16_384


def _budget_arena(cfg: dict[str, Any], args: argparse.Namespace, budget: int) -> ArenaPlan:
    """The ``ArenaPlan`` of ``budget`` bytes for the model (``plan_arena`` over its components at
    ``--kv-dtype``, ``--page-size`` pages, a working state slot per ``--max-live-requests``).

    ``ConfigError`` when a state model's arena has fewer units than ``--max-live-requests``."""
    from flat_kvcache.torch import ModelShape  # the memory plan imported it already

    shape = ModelShape.from_config(cfg, kv_dtype=args.kv_dtype)
    return plan_arena(shape.components(), args.page_size, budget, max_live_requests=args.max_live_requests)


def _pages_in_units(unit_bytes: int, page_bytes: int, num_units: int) -> int:
    """The pages of ``page_bytes`` that lie wholly inside units ``1 .. num_units - 1`` (a page
    straddling two units is never handed out): unit ``u`` holds the pages ``ceil(u U / s) ..
    floor((u + 1) U / s) - 1`` (docs/sizing-api.md, "Arena plan"), a count that depends only
    on ``u U mod s`` and so repeats every ``s / gcd(U mod s, s)`` units."""

    def pages(unit: int) -> int:
        return (unit + 1) * unit_bytes // page_bytes - -(-unit * unit_bytes // page_bytes)

    usable = num_units - 1
    remainder = unit_bytes % page_bytes
    period = 1 if remainder == 0 else page_bytes // math.gcd(remainder, page_bytes)
    if usable <= period:
        return sum(pages(u) for u in range(1, usable + 1))
    whole, rest = divmod(usable, period)
    return whole * sum(pages(u) for u in range(1, period + 1)) + sum(pages(u) for u in range(1, rest + 1))


def _arena_memory(cfg: dict[str, Any], args: argparse.Namespace, arena: ArenaPlan) -> dict[str, Any]:
    """What the SPEC 13 storage (``arena``, an ``ArenaPlan``; ``FlatKVCache(arena=)``) holds:
    the unit, per group its page or slot and how many a unit holds, and for requests of
    ``ARENA_REFERENCE_TOKENS`` tokens each (``T`` tokens computed: all of them in full groups,
    the pages of tokens ``T - W .. T - 1`` in a sliding one, one working state slot) what one
    takes of the arena, its padding, and how many such requests the engine holds at once.

    The figures follow how the engine places pages (docs/sizing-api.md, "Arena plan"): a unit
    is bound to one group; a page group's pages lie at byte ``p * page_bytes``, so a unit holds
    ``per_unit`` or ``per_unit - 1`` pages (a page straddling two units is never handed out)
    and its remainder is lost; a state slot is a whole unit. Pages of many requests share
    units, so a request's attention pages take ``pages / (pages per unit, on average over the
    arena)`` units; requests fit while the units they take, each group's rounded up to whole
    units, are at most the ``num_units - 1`` usable ones."""
    specs = {spec.group_id: spec for spec in simulate.engine_specs(flat_kvcache, cfg, args.page_size)}
    tokens = ARENA_REFERENCE_TOKENS
    usable = arena.num_units - 1
    unit = arena.unit_bytes
    state_ids = {g.group_id for g in arena.groups if g.kind == "state"}
    state_bytes = sum(c.nbytes for c in arena.components if c.group_id in state_ids)
    slots = 1 if state_ids else 0  # one working state slot for all state groups together
    useful = slots * state_bytes
    groups = []
    paged: list[tuple[int, int]] = []  # per page group: pages a request holds, pages in the arena
    for group in arena.groups:
        spec = specs[group.group_id]
        entry: dict[str, Any] = {
            "group_id": group.group_id,
            "kind": group.kind,
            "item_bytes": group.item_bytes,
            "per_unit": group.per_unit,
            "unit_slack_bytes": group.slack_bytes,
        }
        if group.kind == "state":
            entry["held"] = 1
        else:
            page = arena.page_size
            count = -(-tokens // page)
            if spec.sliding_window is not None:
                # The pages of the window the last token attends to, tokens T - W .. T - 1.
                count -= max(0, tokens - spec.sliding_window) // page
            useful += min(tokens, count * page) * group.item_bytes // page
            total = _pages_in_units(unit, group.item_bytes, arena.num_units)
            fewest = group.per_unit if total == group.per_unit * usable else group.per_unit - 1
            paged.append((count, total))
            entry.update(
                held=count,
                fewest_per_unit=fewest,
                pages_in_arena=total,
                mean_per_unit=round(total / usable, 6),
            )
        groups.append(entry)

    def units_for(requests: int) -> int:
        """Units ``requests`` such requests take: a state slot each, each page group's pages
        over as many units as hold them on average, rounded up."""
        return requests * slots + sum(-(-requests * count * usable // total) for count, total in paged)

    # Bisection: the most requests whose units fit (units_for grows with the requests).
    low, high = 0, usable
    while low < high:
        middle = (low + high + 1) // 2
        if units_for(middle) <= usable:
            low = middle
        else:
            high = middle - 1
    held = slots * unit + sum(count * usable * unit / total for count, total in paged)
    return {
        "unit_bytes": unit,
        "num_units": arena.num_units,
        "groups": groups,
        "reference_tokens": tokens,
        "reference_held_bytes": round(held),
        "reference_padding": round(1 - useful / held, 6) if held else 0.0,
        "reference_requests_that_fit": low,
        "reference_tokens_that_fit": low * tokens,
    }


def _memory_shape(cfg: dict[str, Any], args: argparse.Namespace) -> tuple[Any, int]:
    """What both memory plans start from: the model's ``ModelShape`` at ``--kv-dtype`` and the
    context length (``--max-context-len`` or the config's); a ValueError without torch (an
    optional extra) or without a budget to read (``--memory``, or a CUDA ``--device``)."""
    try:
        from flat_kvcache.torch import ModelShape
    except ImportError:
        raise ValueError(f"--memory/--device: the memory plan needs PyTorch, {_extra('torch')}") from None
    context = max_context_len_from_config(cfg) if args.max_context_len is None else args.max_context_len
    if args.memory is None and not str(args.device).startswith("cuda"):
        raise ValueError(f"--device {args.device}: only CUDA devices report free memory; pass --memory")
    try:
        return ModelShape.from_config(cfg, kv_dtype=args.kv_dtype), context
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def _arena_plan_memory(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``plan --storage arena`` (the default for a model with state layers): the SPEC 13 arena of
    the budget (``flat_kvcache.torch.plan_arena_memory``, which reads a CUDA device's budget and
    sets its allocator's slack aside) as a JSON-ready dict, with what requests take of it
    (:func:`_arena_memory`).

    torch is imported here, only when asked for: it is an optional extra.
    """
    shape, context = _memory_shape(cfg, args)
    from flat_kvcache.torch import plan_arena_memory

    try:
        plan = plan_arena_memory(
            shape,
            page_size=args.page_size,
            budget_bytes=args.memory,
            device=args.device,
            utilization=args.utilization,
            max_live_requests=args.max_live_requests,
            max_scheduled_tokens=args.max_scheduled_tokens,
            max_context_len=context,
        )
    except FlatKVCacheError:
        raise  # the plan's own refusal: its message says why
    except RuntimeError as exc:
        if args.device is None:
            raise
        raise ValueError(f"--device {args.device}: {exc}") from None  # torch rejects a device name
    return {
        "storage": "arena",
        "budget_bytes": plan.budget_bytes,
        "allocator_slack_bytes": plan.allocator_slack_bytes,
        "page_size": plan.page_size,
        "total_bytes": plan.total_bytes,
        "kv_dtype": str(shape.kv_dtype).removeprefix("torch."),
        "device": args.device,
        "arena": _arena_memory(cfg, args, plan.arena),
    }


def _memory_plan(cfg: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``plan --storage equalized`` (the default for an attention-only model): the SPEC 3 memory
    plan (``flat_kvcache.torch.plan_kv_memory``) as a JSON-ready dict.

    torch is imported here, only when asked for: it is an optional extra.
    """
    shape, context = _memory_shape(cfg, args)
    from flat_kvcache.torch import plan_kv_memory

    if all(label in STATE_LAYER_TYPES for label in shape.layer_types):
        raise ValueError(
            f"--storage equalized: every one of the {shape.num_layers} cache layers keeps a recurrent "
            "state and none keeps K/V, and equalized pages are sized in tokens of K/V; leave out "
            "--storage equalized to plan the SPEC 13 arena (a state slot per unit)"
        )
    try:
        plan = plan_kv_memory(
            shape,
            page_size=args.page_size,
            budget_bytes=args.memory,
            device=args.device,
            utilization=args.utilization,
            max_live_requests=args.max_live_requests,
            max_scheduled_tokens=args.max_scheduled_tokens,
            max_context_len=context,
            storage="equalized",
        )
    except FlatKVCacheError:
        raise  # the plan's own refusal (a ModelConfigError, a ConfigError): its message says why
    except RuntimeError as exc:
        if args.device is None:
            raise
        raise ValueError(f"--device {args.device}: {exc}") from None  # torch rejects a device name
    # Per-layer K/V takes the slab saving more per page; the native plan divides the same budget.
    per_layer_bytes_per_page = plan.bytes_per_page + plan.slab_saving_bytes // plan.num_pages
    return {
        "storage": "equalized",
        **plan.summary(),
        "per_layer_num_pages": (plan.budget_bytes - plan.allocator_slack_bytes) // per_layer_bytes_per_page,
        "requested_page_size": plan.requested_page_size,
        "allocator_slack_bytes": plan.allocator_slack_bytes,
        "kv_dtype": str(shape.kv_dtype).removeprefix("torch."),
        "device": args.device,
    }


def _print_presets(*, as_json: bool) -> None:
    """``plan --list-presets``: each preset's name and layer mix, as a table or as JSON."""
    mixes = {name: dict(Counter(layer_types_from_config(get_preset(name)))) for name in preset_names()}
    if as_json:
        presets = [
            {"name": name, "default": name == DEFAULT_PRESET, "layer_types": mix}
            for name, mix in mixes.items()
        ]
        print(json.dumps(presets, indent=2))
        return
    rows = [
        (
            name + (" (default)" if name == DEFAULT_PRESET else ""),
            ", ".join(f"{count} {label}" for label, count in mix.items()),
        )
        for name, mix in mixes.items()
    ]
    width = max(len(name) for name, _ in rows)
    for name, summary in rows:
        print(f"{name:<{width}}  {summary}")


#: What the plan's numbers are; the JSON carries these under ``notes``, the table says the same.
NOTES = {
    "max_pages": (
        "each group's worst case under the settings (SPEC 2). All groups draw on one shared pool, "
        "so these are per-group upper bounds, not shares of the pool, and they do not add up"
    ),
    "pages_for_all_worst_cases": (
        "the pool, page 0 included, that holds every group's worst case at once: "
        "1 + the sum of (max_pages - 1), each group's count holding page 0 once"
    ),
    "max_total_tokens_that_fit": (
        "with a memory plan: the largest max_total_tokens for which every group's worst case fits "
        "in the pool at once (the default max_total_tokens then)"
    ),
    "table_width": (
        "the columns of a request's block table at max_context_len (absolute tables: the width of "
        "block_tables(out=) buffers, bind_rows tables and CaptureBuffers)"
    ),
    "windowed_width": (
        "sliding groups: the columns of a windowed table, whose rows show the last slots from a "
        "per-row offset (bind_rows(offsets=), CaptureBuffers(sliding_offsets=True)); SPEC 2's "
        "capture width of the group"
    ),
}


def build_plan(
    cfg: dict[str, Any],
    *,
    source: str,
    page_size: int,
    max_live_requests: int,
    max_scheduled_tokens: int,
    max_total_tokens: int | None,
    max_context_len: int | None,
    decode_input_tokens: int = 1,
    overlap_schedule_depth: int = 0,
    safety_margin: int = 0,
    num_pages: int | None = None,
) -> dict[str, Any]:
    """The plan of a model config as a JSON-ready dict, computed with the public (native) API.

    ``max_context_len`` None takes the config's. ``num_pages`` is the pool of a memory plan (page
    0 included), or None. ``max_total_tokens`` None takes, with ``num_pages``, the most tokens for
    which every group's worst case fits in the pool at once (the pool's whole ``(num_pages - 1) *
    page_size`` if not even 0 does), else ``max(DEFAULT_MAX_TOTAL_TOKENS, max_context_len)``.
    :data:`NOTES` says what the numbers are.
    """
    read = read_model_layers(cfg)
    layer_types = list(read.layer_types)
    window = sliding_window_from_config(cfg)
    context = max_context_len_from_config(cfg) if max_context_len is None else max_context_len
    specs = group_specs_from_config(cfg, page_size=page_size)

    def page_counts(total: int) -> dict[str, int]:
        return flat_kvcache.compute_paged_cache_group_page_counts(
            specs,
            max_live_requests=max_live_requests,
            max_scheduled_tokens=max_scheduled_tokens,
            max_total_tokens=total,
            max_context_len=context,
            decode_input_tokens=decode_input_tokens,
            overlap_schedule_depth=overlap_schedule_depth,
            safety_margin=safety_margin,
        )

    fit = None if num_pages is None else _tokens_that_fit(page_counts, num_pages, page_size)
    if max_total_tokens is not None:
        total = max_total_tokens
    elif num_pages is not None:
        total = (num_pages - 1) * page_size if fit is None else fit
    else:
        total = max(DEFAULT_MAX_TOTAL_TOKENS, context)
    counts = page_counts(total)
    together = _pages_for_all(counts)

    def widths(spec: flat_kvcache.PagedCacheGroupSpec) -> tuple[int, int | None]:
        """The absolute table width and, for a sliding group, the windowed one."""

        def width(of: flat_kvcache.PagedCacheGroupSpec) -> int:
            return flat_kvcache.compute_max_logical_pages_for_capture(
                of,
                max_context_len=context,
                max_tokens_per_req=decode_input_tokens,
                overlap_schedule_depth=overlap_schedule_depth,
            )

        if spec.retention != "sliding_window":
            return width(spec), None
        # An absolute sliding table keeps growing (holes in front): a full-history width.
        as_full = dataclasses.replace(spec, retention="full_history", sliding_window_tokens=None)
        return width(as_full), width(spec)

    layers_per_group: Counter[str] = Counter(flat_kvcache.layer_group_ids(layer_types, window))
    groups = []
    for spec in specs:
        table_width, windowed_width = widths(spec)
        groups.append(
            {
                "group_id": spec.group_id,
                "retention": spec.retention,
                "sliding_window_tokens": spec.sliding_window_tokens,
                "family": spec.family,
                "state": spec.family == "state",
                "rows_per_page": spec.rows_per_page,
                "entry_stride_tokens": spec.entry_stride_tokens,
                "num_layers": layers_per_group[spec.group_id],
                "max_pages": counts[spec.group_id],
                "table_width": table_width,
                "windowed_width": windowed_width,
            }
        )
    return {
        "model": {
            "source": source,
            "model_type": cfg.get("model_type"),
            "family": read.family,
            "num_layers": read.num_model_layers,
            "num_cache_layers": len(layer_types),
            "layer_types": dict(Counter(layer_types)),
            "state_kind": read.state_kind,
        },
        "flat_kvcache": flat_kvcache.FLAT_KVCACHE,
        "settings": {
            "page_size": page_size,
            "max_live_requests": max_live_requests,
            "max_scheduled_tokens": max_scheduled_tokens,
            "max_total_tokens": total,
            "max_context_len": context,
            "decode_input_tokens": decode_input_tokens,
            "overlap_schedule_depth": overlap_schedule_depth,
            "safety_margin": safety_margin,
        },
        "groups": groups,
        "pool": {
            "pages_for_all_worst_cases": together,
            "num_pages": num_pages,
            "fits": None if num_pages is None else together <= num_pages,
            "max_total_tokens_that_fit": fit,
        },
        "hybrid_slab_group_size": flat_kvcache.hybrid_slab_group_size(
            layer_types, sliding_window_tokens=window
        ),
        "notes": dict(NOTES),
    }


def _pages_for_all(counts: Mapping[str, int]) -> int:
    """The pool (page 0 included) that holds every group's worst case at once: each count
    includes the null page, which the groups share."""
    return 1 + sum(count - 1 for count in counts.values())


def _tokens_that_fit(
    page_counts: Callable[[int], dict[str, int]], num_pages: int, page_size: int
) -> int | None:
    """The largest ``max_total_tokens`` whose worst cases all fit in ``num_pages`` pages at once,
    or None if not even 0 does. Every count grows with it, so a bisection finds it."""
    if _pages_for_all(page_counts(0)) > num_pages:
        return None
    low, high = 0, (num_pages - 1) * page_size  # no group holds more tokens than the pool
    while low < high:
        middle = (low + high + 1) // 2
        if _pages_for_all(page_counts(middle)) <= num_pages:
            low = middle
        else:
            high = middle - 1
    return low


def _cache_layer_count(num_layers: int, num_cache_layers: int) -> str:
    """How the cache layers differ from the model's layers, for :func:`format_plan`: fewer
    (MLP-only layers keep none), or more (a layer holding both K/V and a state is two)."""
    if num_cache_layers < num_layers:
        return f", {num_cache_layers} with a cache"
    if num_cache_layers > num_layers:
        return f", {num_cache_layers} cache layers (a layer holding both K/V and a state is two)"
    return ""


def format_plan(plan: dict[str, Any]) -> str:
    """A plan from :func:`build_plan` as a readable, aligned table with what its numbers are."""
    model, settings, pool = plan["model"], plan["settings"], plan["pool"]
    mix = ", ".join(f"{count} {label}" for label, count in model["layer_types"].items())
    lines = [
        f"model: {model['source']} ({model['model_type'] or 'unknown type'}, read as {model['family']}), "
        f"{model['num_layers']} layers"
        + _cache_layer_count(model["num_layers"], model["num_cache_layers"])
        + f": {mix}"
        + (f" ({model['state_kind']} state)" if model["state_kind"] else ""),
        "settings: " + ", ".join(f"{key}={value}" for key, value in settings.items()),
        "",
    ]
    header = ("group", "retention", "window", "family", "layers", "max pages", "table width", "windowed", "")
    rows = [
        (
            group["group_id"],
            group["retention"],
            _cell(group["sliding_window_tokens"]),
            group["family"],
            str(group["num_layers"]),
            str(group["max_pages"]),
            str(group["table_width"]),
            _cell(group["windowed_width"]),
            "*" if group["state"] else "",
        )
        for group in plan["groups"]
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    numeric = {2, 4, 5, 6, 7}  # right-aligned columns

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    lines += [line(header), *(line(row) for row in rows), ""]
    together = (
        f"a pool of {pool['pages_for_all_worst_cases']} pages holds every group's worst case at once "
        "(each count includes the null page 0, which the pool has once)"
    )
    if pool["num_pages"] is not None:
        together += f"; this pool has {pool['num_pages']}"
        if not pool["fits"]:
            over = [g["group_id"] for g in plan["groups"] if g["max_pages"] > pool["num_pages"] - 1]
            together += ", so at worst requests wait or are preempted (SPEC 9)"
            if over:
                each = "each " if len(over) > 1 else ""
                together += f", and {' and '.join(over)} {each}alone can want more than all of it"
    notes = [
        f"max pages: {NOTES['max_pages']}: {together}.",
        "table width: the columns of a request's block table at max context (block_tables(out=), "
        "bind_rows, CaptureBuffers); windowed: a sliding group's columns when each row shows only "
        "its last slots from a per-row offset (bind_rows(offsets=), CaptureBuffers(sliding_offsets=True)).",
    ]
    if any(group["state"] for group in plan["groups"]):
        notes.append(
            "* state group: pages hold recurrent-state snapshots; CUDA-graph capture buffers are "
            "allocated for the other groups only."
        )
    lines += [textwrap.fill(note, width=100, subsequent_indent="  ") for note in notes]
    slab = plan["hybrid_slab_group_size"]
    if slab is not None:
        lines.append(f"hybrid slab group size: {slab} (layer i of every label shares K/V slab i)")
    elif not plan["flat_kvcache"]:
        lines.append("hybrid slab group size: none (built without the flat feature)")
    else:
        lines.append("hybrid slab group size: none (per-layer K/V buffers)")
    if "memory" in plan:
        lines += ["", *_format_memory(plan["memory"], pool, settings)]
    return "\n".join(lines)


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _format_memory(memory: dict[str, Any], pool: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The memory plan's lines for :func:`format_plan`: the arena's (``storage`` ``"arena"``) or
    the equalized pages' with the arena of the same budget after them."""

    def size(nbytes: int) -> str:
        return f"{nbytes} bytes ({nbytes / (1 << 30):.2f} GiB)"

    slack = memory["allocator_slack_bytes"]
    budget = size(memory["budget_bytes"]) + (f", less {slack} bytes of allocator slack" if slack else "")
    budget += f" on {memory['device']}" if memory["device"] else ""
    if memory["storage"] == "arena":
        head = [
            "memory (storage: arena, the SPEC 13 storage: FlatKVCache(specs, arena=plan); --storage "
            "equalized for SPEC 3's equal pages, the layout vLLM-style storage uses):",
            f"  budget           {budget}",
            f"  kv dtype         {memory['kv_dtype']}",
            f"  page size        {memory['page_size']} tokens (attention pages; a state slot is a unit)",
            f"  arena            {size(memory['total_bytes'])}",
        ]
        return [
            *textwrap.wrap(head[0], width=100, subsequent_indent="  "),
            *head[1:],
            *_format_arena(memory["arena"]),
        ]
    page = f"{memory['page_size']} tokens"
    if memory["page_size"] != memory["requested_page_size"]:
        page += f" (raised from {memory['requested_page_size']} so a page holds a state snapshot)"
    fit = pool["max_total_tokens_that_fit"]
    if fit is None:
        together = (
            f"none with every group at its worst case: that of {settings['max_live_requests']} "
            "requests holding no tokens is more than the pool; lower --max-live-requests"
        )
    else:
        together = f"{fit} with every group at its worst case at once"
        if settings["max_total_tokens"] == fit:
            together += " (the max_total_tokens above)"
    slots = f"{memory['tokens_that_fit']} token slots in the pool in all ((pages - 1) x page size)"
    if memory["slab_group_size"]:
        layout = (
            f"{memory['slab_group_size']} slabs (layer i of every label shares slab i): "
            f"{memory['per_layer_num_pages']} pages with per-layer K/V buffers instead"
        )
    else:
        layout = "one K and one V buffer per attention layer (no slab pairing)"
    rows = [
        ("storage", "equalized (SPEC 3: one pool of equal pages, the layout vLLM-style storage uses)"),
        ("budget", budget),
        ("kv dtype", memory["kv_dtype"]),
        ("page size", page),
        ("bytes per page", str(memory["bytes_per_page"])),
        ("pages", f"{memory['num_pages']} in one pool shared by all groups (page 0 is the null page)"),
        ("tokens that fit", together),
        ("", slots),
        ("buffers", size(memory["total_bytes"])),
        ("K/V layout", layout),
    ]
    width = max(len(name) for name, _ in rows)
    lines = ["memory:", *(f"  {name:<{width}}  {value}" for name, value in rows)]
    if "arena" in memory:
        title = (
            "arena (SPEC 13 storage, FlatKVCache(specs, arena=plan_arena(...)); same budget; "
            "--storage arena plans it alone):"
        )
        lines += [
            "",
            *textwrap.wrap(title, width=100, subsequent_indent="  "),
            *_format_arena(memory["arena"]),
        ]
    return lines


def _format_arena(arena: dict[str, Any]) -> list[str]:
    """The SPEC 13 storage's lines for :func:`format_plan` (``FlatKVCache(arena=)``)."""
    lines = [
        f"  unit             {arena['unit_bytes']} bytes, {arena['num_units']} units (unit 0 is null)",
    ]
    for group in arena["groups"]:
        if group["kind"] == "state":
            lines.append(
                f"  {group['group_id']:<16} state slot of {group['item_bytes']} bytes, 1 per unit "
                f"({group['unit_slack_bytes']} bytes of a unit left over)"
            )
            continue
        most, fewest = group["per_unit"], group["fewest_per_unit"]
        if most == fewest:
            per_unit = f"{most} per unit ({group['unit_slack_bytes']} bytes of each unit left over)"
        else:
            per_unit = (
                f"{fewest} or {most} per unit, {group['mean_per_unit']:g} on average (a page "
                "straddling two units is never handed out)"
            )
        lines.append(f"  {group['group_id']:<16} page of {group['item_bytes']} bytes, {per_unit}")
    tokens = arena["reference_tokens"]
    held = ", ".join(f"{group['held']} {group['group_id']}" for group in arena["groups"])
    lines.append(
        f"  a {tokens}-token request holds {held}: {arena['reference_held_bytes']} bytes of units, "
        f"padding {arena['reference_padding']:.2%} (unit remainders included); "
        f"{arena['reference_requests_that_fit']} such requests fit at once, "
        f"{arena['reference_tokens_that_fit']} tokens"
    )
    return [textwrap.fill(line, width=100, subsequent_indent=" " * 19) for line in lines]
