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
    assert (
        "FlatKVCache.schedule" in docs and "FlatKVCache.slot_of" in docs and "PageCache.decode_step" in docs
    )
    leaks = {name: RUSTDOC_LINK.findall(doc) for name, doc in docs.items() if RUSTDOC_LINK.search(doc)}
    assert leaks == {}


def test_public_docstrings_name_no_binding_internals() -> None:
    internals = ("IdMemo", "idmemo", "npscalar", "RequestHandle", "PyFlatKVCache")
    leaks = {name: [w for w in internals if w in doc] for name, doc in public_docstrings().items()}
    assert {name: words for name, words in leaks.items() if words} == {}


#: The token-level calls the slot API removed (docs/requests-api.md, "Slots").
REMOVED = ("schedule_batch", "schedule_rows", "append_tokens_batch", "append_tokens_rows", "row_of")


def test_token_level_docstrings_name_no_removed_method() -> None:
    """``FlatKVCache``'s docstrings describe the slot API: none points a user at a method it no
    longer has (``has_request`` is ``PageCache``'s, so it is only checked on ``FlatKVCache``)."""
    docs = {name: doc for name, doc in public_docstrings().items() if name.split(".")[0] == "FlatKVCache"}
    assert "FlatKVCache.schedule" in docs
    stale = {
        name: [word for word in (*REMOVED, "has_request") if re.search(rf"\b{word}\b", doc)]
        for name, doc in docs.items()
    }
    assert {name: words for name, words in stale.items() if words} == {}
    assert not any(hasattr(flat_kvcache.FlatKVCache, word) for word in (*REMOVED, "has_request"))
