"""vLLM's own v1 scheduler on flat-kvcache (``pip install '.[vllm]'``).

One config line switches a vLLM engine to it::

    from vllm import LLM
    llm = LLM(model, scheduler_cls="flat_kvcache.vllm.FlatScheduler")

:class:`FlatScheduler` is vLLM's ``AsyncScheduler`` (the engine's default) whose
``kv_cache_manager`` is :class:`FlatKVCacheManager`: the page-level engine
(:class:`flat_kvcache.PageCache`) keyed by vLLM's own ``request.block_hashes``, returning vLLM's
``KVCacheBlocks`` whose block ids are our page ids (0 is the null block). What is supported and
what is refused at construction: docs/vllm.md. Only this package imports vLLM, and only when one
of its names is used.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__all__ = [
    "MAMBA_CHECKPOINTS",
    "FlatKVCacheManager",
    "FlatScheduler",
    "UnsupportedVllmConfigError",
    "adapter_options",
    "check_supported",
]

_HOME = {
    "FlatKVCacheManager": "_manager",
    "UnsupportedVllmConfigError": "_manager",
    "check_supported": "_manager",
    "adapter_options": "_manager",
    "MAMBA_CHECKPOINTS": "_manager",
    "FlatScheduler": "_scheduler",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'flat_kvcache.vllm' has no attribute {name!r}")
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"flat_kvcache.vllm.{name} needs vLLM: pip install '.[vllm]' (docs/vllm.md)")
    return getattr(importlib.import_module(f"flat_kvcache.vllm.{home}"), name)
