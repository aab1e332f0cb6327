"""The README's Python examples run as written (each block asserts its own claims)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    code = BLOCKS[index]
    if "flat_kvcache.torch" in code:
        try:
            import torch  # noqa: F401
        except ImportError:
            if os.environ.get("CI"):
                raise
            pytest.skip("torch is not installed (pip install '.[torch]')")
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme_example"})
