"""GPU check of flat_kvcache.torch on a real CUDA device (not run in CI).

Plans the KV buffers of a model for a memory budget, allocates them, and checks that:

1. the memory actually taken (``torch.cuda.memory_allocated`` and the ``mem_get_info`` delta)
   stays within the budget, and the buffers hold exactly the planned bytes;
2. page 0 (the null page) is zero, and slab sharing holds (layer i of every label, one tensor);
3. capture buffers filled from a flat cache's block tables on the GPU hold those tables, in the
   same storage every step, and a CUDA graph captured over them sees each new fill;
4. write / extend locations computed on the GPU match a plain Python loop, and writing K rows
   through them lands inside the buffers;
5. tiny random GPT-OSS-style and Qwen2 models computed through the cache's tables, write
   locations and CUDA K/V slabs (flat_kvcache.torch.runner, the same code as the CPU model tests)
   match their own forward, through the capture buffers in both modes, and over several decode
   steps replayed from one captured CUDA graph; with ``flashinfer`` importable, FlashInfer's
   paged decode on the same tables matches the torch reference op (needs ``transformers``).

Usage::

    python benches/gpu_check.py                                  # default preset, 90% of the GPU
    python benches/gpu_check.py --preset qwen3.5-like --memory 8GiB
    python benches/gpu_check.py --device cpu --memory 256MiB     # the same flow, no memory checks

Exit status: 0 when every check passes (or, with the default --device cuda, when there is no
CUDA device: the run prints "no CUDA device: skipped"), 1 when one fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import random
import re
import sys
from pathlib import Path
from typing import Any

try:
    import torch
except ModuleNotFoundError:
    sys.exit("gpu_check needs PyTorch: pip install '.[torch]' in the flat-kvcache source tree")

import flat_kvcache
from flat_kvcache import reference
from flat_kvcache.config import load_model_config
from flat_kvcache.presets import get_preset, preset_names
from flat_kvcache.torch import (
    CaptureBuffers,
    KVBuffers,
    KVMemoryPlan,
    ModelShape,
    allocate_kv_buffers,
    extend_locations,
    plan_kv_memory,
    write_locations,
)

MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"`` or a plain byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 8GiB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class Report:
    """Collects check results and prints them as a table."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool | None]] = []

    def value(self, name: str, value: object) -> None:
        self.rows.append((name, str(value), None))

    def check(self, name: str, ok: bool, detail: object = "") -> None:
        self.rows.append((name, str(detail), bool(ok)))

    @property
    def failed(self) -> list[str]:
        return [name for name, _, ok in self.rows if ok is False]

    def print(self) -> None:
        width = max(len(name) for name, _, _ in self.rows)
        for name, detail, ok in self.rows:
            mark = "" if ok is None else ("ok  " if ok else "FAIL")
            print(f"{mark:4}  {name:<{width}}  {detail}")


def gib(nbytes: int) -> str:
    return f"{nbytes} ({nbytes / GiB:.2f} GiB)"


def check_memory(
    args: argparse.Namespace, shape: ModelShape, device: torch.device, report: Report
) -> tuple[KVMemoryPlan, KVBuffers]:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free_before, total = torch.cuda.mem_get_info(device)
        allocated_before = torch.cuda.memory_allocated(device)
        report.value(
            "device", f"{torch.cuda.get_device_name(device)}, {gib(total)} total, {gib(free_before)} free"
        )
    plan = plan_kv_memory(
        shape,
        page_size=args.page_size,
        budget_bytes=args.memory,
        device=device,
        utilization=args.utilization,
        max_live_requests=args.max_live_requests,
        max_scheduled_tokens=args.max_scheduled_tokens,
        max_context_len=args.max_context_len,
        storage="equalized",  # this check is of SPEC 3's buffers (a state model's default is the arena)
    )
    report.value("budget", gib(plan.budget_bytes))
    report.value("page size (tokens)", f"{plan.page_size} (asked {plan.requested_page_size})")
    report.value("bytes per page", plan.bytes_per_page)
    report.value("pages (page 0 included)", plan.num_pages)
    report.value("tokens that fit", plan.max_total_tokens)
    report.value("slab group size", plan.slab_group_size)
    report.value("slab saving", gib(plan.slab_saving_bytes))
    report.value("planned bytes", f"{gib(plan.total_bytes)} in {len(plan.tensors)} tensors")

    buffers = allocate_kv_buffers(plan, device)
    report.check("allocated bytes == planned bytes", buffers.nbytes() == plan.total_bytes, buffers.nbytes())
    report.check("planned bytes <= budget", plan.total_bytes <= plan.budget_bytes)
    if cuda:
        torch.cuda.synchronize(device)
        allocated = torch.cuda.memory_allocated(device) - allocated_before
        taken = free_before - torch.cuda.mem_get_info(device)[0]
        report.check("memory_allocated delta <= budget", allocated <= plan.budget_bytes, gib(allocated))
        report.check("mem_get_info delta <= budget", taken <= plan.budget_bytes, gib(taken))
    return plan, buffers


def check_layout(plan: KVMemoryPlan, buffers: KVBuffers, report: Report) -> None:
    shape = plan.shape
    attention = [i for i, label in enumerate(shape.layer_types) if label != "linear_attention"]
    state = [i for i, label in enumerate(shape.layer_types) if label == "linear_attention"]
    zero = all(
        not buffers.k(i)[: plan.page_size].any() and not buffers.v(i)[: plan.page_size].any()
        for i in attention
    )
    zero = zero and all(not t[0].any() for i in state for t in buffers.state(i).values())
    report.check("page 0 is zero", zero)
    if plan.slab_group_size is not None:
        shared = all(
            len(spec.layers) > 1 and buffers.k(spec.layers[0]) is buffers.k(spec.layers[-1])
            for spec in plan.tensors
        )
        report.check("layer i of every label shares slab i", shared)


def flat_tables(plan: KVMemoryPlan, num_reqs: int, rng: random.Random) -> tuple[dict[str, Any], list[int]]:
    """Block tables of requests decoding at random lengths ``n`` (the token at ``n - 1`` is new)."""
    engine: Any = flat_kvcache if hasattr(flat_kvcache, "PageCache") else reference
    cache = engine.PageCache(engine.kv_cache_specs(list(plan.groups)), plan.num_pages)
    lengths: list[int] = []
    for req in range(num_reqs):
        n = rng.randint(1, max(1, plan.max_context_len // 4))
        if not cache.acquire(req, n):
            break
        cache.reclaim(req, n - 1)  # slid-out sliding pages become holes
        lengths.append(n)
    return cache.block_tables(list(range(len(lengths)))), lengths


def capture_graph(
    capture: CaptureBuffers, group_id: str, positions: torch.Tensor, page_size: int
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph computing write locations from a capture buffer (warmed up on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            write_locations(capture.buffer(group_id), positions, page_size)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = write_locations(capture.buffer(group_id), positions, page_size)
    return graph, out


def check_capture(plan: KVMemoryPlan, buffers: KVBuffers, device: torch.device, report: Report) -> None:
    rng = random.Random(0)
    batch_max, page = 8, plan.page_size
    sliding = {g.group_id for g in plan.groups if g.retention == "sliding_window"}
    capture = CaptureBuffers(
        plan.groups,
        max_batch_size=batch_max,
        max_context_len=plan.max_context_len,
        device=device,
        sliding_offsets=True,
    )
    report.value("capture widths", {g: capture.width(g) for g in capture.group_ids})
    full = next((g for g in capture.group_ids if g not in sliding), None)
    if full is None:
        report.value("locations", "no full-history group: skipped")
        return
    pointers = {g: capture.buffer(g).data_ptr() for g in capture.group_ids}
    positions = torch.zeros(batch_max, dtype=torch.int64, device=device)
    graph = capture_graph(capture, full, positions, page) if device.type == "cuda" else None
    k = buffers.k(plan.shape.layer_types.index("full_attention"))
    ok = {"fill": True, "locations": True, "graph": True, "write": True}
    for _step in range(4):
        tables, lengths = flat_tables(plan, rng.randint(1, batch_max), rng)
        batch = len(lengths)
        capture.fill(tables, batch_size=batch)
        if batch == 0:  # not even one request fit in this budget
            ok["fill"] &= all(not capture.buffer(g).any() for g in capture.group_ids)
            continue
        for group_id in capture.group_ids:
            got = capture.buffer(group_id).cpu()
            width = got.shape[1]
            starts = capture.page_offsets(group_id).cpu() if group_id in sliding else torch.zeros(batch_max)
            for r in range(batch):
                row = [int(p) for p in tables[group_id][r]]
                start = int(starts[r])
                window = row[start : start + width]
                ok["fill"] &= got[r].tolist() == window + [-1] * (width - len(window))
            ok["fill"] &= not got[batch:].any()
        table = tables[full]
        new = [n - 1 for n in lengths]
        expected = [int(table[r][p // page]) * page + p % page for r, p in enumerate(new)]
        positions.zero_()
        positions[:batch] = torch.tensor(new, device=device)
        loc = write_locations(capture.buffer(full)[:batch], positions[:batch], page, check=True)
        ok["locations"] &= loc.cpu().tolist() == expected
        prefix = [max(0, n - 5) for n in lengths]
        extend = [n - p for n, p in zip(lengths, prefix, strict=True)]
        ext = extend_locations(capture.buffer(full)[:batch], prefix, extend, page, check=True)
        ok["locations"] &= ext.cpu().tolist() == [
            int(table[r][p // page]) * page + p % page
            for r in range(batch)
            for p in range(prefix[r], lengths[r])
        ]
        if graph is not None:
            graph[0].replay()
            out = graph[1].cpu()
            ok["graph"] &= out[:batch].tolist() == expected and not out[batch:].any()
        k[loc] = 1
        ok["write"] &= bool(k[loc].eq(1).all()) and int(loc.max()) < k.shape[0]
        k[loc] = 0
    report.check("capture fill holds the tables (tail + offsets)", ok["fill"])
    report.check(
        "capture storage never moves", all(capture.buffer(g).data_ptr() == p for g, p in pointers.items())
    )
    report.check("write/extend locations match a loop", ok["locations"])
    if graph is not None:
        report.check("CUDA graph replay sees each fill", ok["graph"])
    report.check("K rows written through the locations", ok["write"])


def check_model(device: torch.device, report: Report) -> None:
    """Tiny random models through the paged path on ``device`` vs their own forward."""
    if importlib.util.find_spec("transformers") is None:
        report.value("model comparison", "skipped: transformers is not installed")
        return
    from flat_kvcache.torch import runner as paged

    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    tolerance = 1e-3

    def runner(model: Any, mode: str | None) -> paged.PagedModelRunner:
        plan = paged.plan_for_pages(
            paged.model_shape(model.config),
            page_size=4,
            num_pages=96,
            max_live_requests=4,
            max_scheduled_tokens=64,
            max_context_len=128,
        )
        buffers = allocate_kv_buffers(plan, device)
        cache = flat_kvcache.FlatKVCache(flat_kvcache.kv_cache_specs(plan.groups), plan.num_pages)
        capture = None
        if mode is not None:
            capture = CaptureBuffers(
                plan.groups,
                max_batch_size=4,
                max_context_len=128,
                device=device,
                sliding_offsets=mode == "windowed",
            )
        return paged.PagedModelRunner(model, cache, buffers, capture=capture, poison_new_pages=True)

    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1, 64) for _ in range(5 + 7 * i)] for i in range(3)}
    model = paged.tiny_model("gpt-oss", device=device)
    for mode in (None, "absolute", "windowed"):
        records = paged.run_greedy(
            runner(model, mode), prompts, 24, chunk_size=1 if mode == "windowed" else 8
        )
        error = paged.max_logit_error(model, records, device)
        report.check(
            f"gpt-oss-style model, capture {mode or 'off'}: max |diff| {error:.1e}", error <= tolerance
        )
    model = paged.tiny_model("qwen2", intermediate_size=32, device=device)
    for mode in ("absolute", "windowed"):
        decoder = runner(model, mode)
        records = paged.run_decode_graph(decoder, prompts, 16, use_graph=device.type == "cuda")
        error = paged.max_logit_error(model, records, device)
        report.check(
            f"CUDA graph decode, 16 replays, {mode} tables: max |diff| {error:.1e}", error <= tolerance
        )
    check_flashinfer(device, report)


def check_flashinfer(device: torch.device, report: Report) -> None:
    """FlashInfer's paged decode on the cache's tables vs the torch reference op."""
    try:
        import flashinfer
    except ImportError:
        report.value("flashinfer", "skipped: not importable")
        return
    from flat_kvcache.torch import paged_attention

    page, heads, kv_heads, dim = 16, 8, 2, 64
    groups = flat_kvcache.group_specs_from_layer_types(["full_attention"], None, page_size=page)
    cache = flat_kvcache.FlatKVCache(flat_kvcache.kv_cache_specs(groups), 64)
    lengths = [37, 100, 5]
    reqs = [f"q{i}" for i in range(len(lengths))]
    slots = [
        cache.add_request(req, list(range(1, n + 1)), use_prefix_cache=False)[0]
        for req, n in zip(reqs, lengths, strict=True)
    ]
    assert cache.schedule(slots, lengths).all()
    table = torch.from_numpy(cache.block_tables(slots)["full_attention"]).to(device)
    k = torch.randn(64 * page, kv_heads, dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(len(reqs), heads, dim, device=device, dtype=torch.float16)
    seq = torch.tensor(lengths, device=device)
    expected = paged_attention(q, k, v, table, seq, torch.ones_like(seq), page)
    pages_per_row = [(n + page - 1) // page for n in lengths]
    indptr = torch.tensor([0, *itertools.accumulate(pages_per_row)], dtype=torch.int32, device=device)
    indices = torch.cat([table[r, :c] for r, c in enumerate(pages_per_row)]).int()
    last = torch.tensor([(n - 1) % page + 1 for n in lengths], dtype=torch.int32, device=device)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, heads, kv_heads, dim, page, data_type=torch.float16)
    paged_k = k.view(64, page, kv_heads, dim)
    paged_v = v.view(64, page, kv_heads, dim)
    got = wrapper.run(q, (paged_k, paged_v))
    error = float((got.float() - expected.float()).abs().max())
    report.check(f"FlashInfer paged decode on flat tables: max |diff| {error:.1e}", error <= 1e-2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--config", metavar="PATH", help="a Hugging Face style config.json (or its folder)")
    model.add_argument("--preset", metavar="NAME", help="a built-in model preset (default gpt-oss-like)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory", type=parse_bytes, help="budget (e.g. 8GiB); default: from the device")
    parser.add_argument("--utilization", type=float, default=0.9)
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-live-requests", type=int, default=64)
    parser.add_argument("--max-scheduled-tokens", type=int, default=8192)
    parser.add_argument("--max-context-len", type=int, default=32768)
    parser.add_argument("--skip-model", action="store_true", help="skip the tiny-model comparison")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device: skipped (torch.cuda.is_available() is False); "
            "run it on a GPU machine, or use --device cpu --memory SIZE for a dry run"
        )
        return 0
    if device.type != "cuda" and args.memory is None:
        parser.error("--memory is required without a CUDA device")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # streams and graphs below use the current device

    if args.preset is not None and args.preset not in preset_names():
        parser.error(f"--preset {args.preset}: unknown preset; known presets: {', '.join(preset_names())}")
    if args.config is not None and not os.path.exists(args.config):
        parser.error(f"--config {args.config}: no such file or folder")
    model = args.config if args.config is not None else (args.preset or "gpt-oss-like")

    report = Report()
    try:
        shape = ModelShape.from_config(
            load_model_config(Path(model)) if args.config is not None else get_preset(model),
            kv_dtype=args.kv_dtype,
        )
        report.value("model", f"{model}: {shape.num_layers} layers, kv {shape.kv_dtype}")
        plan, buffers = check_memory(args, shape, device, report)
    except (OSError, ValueError) as exc:
        print(f"gpu_check: cannot plan: {exc}", file=sys.stderr)
        return 1
    check_layout(plan, buffers, report)
    check_capture(plan, buffers, device, report)
    if not args.skip_model:
        check_model(device, report)
    report.print()
    if report.failed:
        print(
            f"\ngpu_check: {len(report.failed)} check(s) failed: {', '.join(report.failed)}", file=sys.stderr
        )
        return 1
    print("\ngpu_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
