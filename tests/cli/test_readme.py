"""The README's Python examples run as written (each block asserts its own claims)."""

from __future__ import annotations

import re

import pytest
from helpers import REPO_ROOT, need

README = REPO_ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
#: The blocks that use flat_kvcache.torch need torch (the ``torch`` marker).
NEEDS_TORCH = [(pytest.mark.torch,) if "flat_kvcache.torch" in code else () for code in BLOCKS]


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", [pytest.param(i, marks=NEEDS_TORCH[i]) for i in range(len(BLOCKS))])
def test_readme_example_runs(index: int) -> None:
    code = BLOCKS[index]
    if NEEDS_TORCH[index]:
        need("torch")
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme_example"})
