"""Public docstrings are written for Python users.

The native classes' docstrings come from Rust doc comments, where intra-doc links
(``[`Name`]``) point at Rust items: copied to Python they name internals a user cannot import
(such as the bindings' id memo) and show the link brackets verbatim.
"""

from __future__ import annotations

import inspect
import re

import flat_kvcache

RUSTDOC_LINK = re.compile(r"\[`[^`\]]+`\]")


def public_docstrings() -> dict[str, str]:
    """Every public name of ``flat_kvcache`` and every public member of its classes."""
    docs: dict[str, str] = {}
    for name in flat_kvcache.__all__:
        obj = getattr(flat_kvcache, name)
        docs[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member in dir(obj):
                if not member.startswith("_"):
                    docs[f"{name}.{member}"] = inspect.getdoc(getattr(obj, member)) or ""
    return docs


def test_public_docstrings_have_no_rustdoc_links() -> None:
    docs = public_docstrings()
    assert "FlatKVCache.schedule_batch" in docs and "PageCache.decode_step" in docs
    leaks = {name: RUSTDOC_LINK.findall(doc) for name, doc in docs.items() if RUSTDOC_LINK.search(doc)}
    assert leaks == {}


def test_public_docstrings_name_no_binding_internals() -> None:
    internals = ("IdMemo", "idmemo", "npscalar", "RequestHandle", "PyFlatKVCache")
    leaks = {name: [w for w in internals if w in doc] for name, doc in public_docstrings().items()}
    assert {name: words for name, words in leaks.items() if words} == {}
