"""The one Python example of a docs page, as a test runs it."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_example(page: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert len(blocks) == 1, "the page holds one Python example"
    return blocks[0]
