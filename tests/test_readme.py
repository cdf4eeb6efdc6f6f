"""The README lists every registered policy and its Python example runs as written."""

import re
from pathlib import Path

from moestream.policies import POLICIES

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_registered_policy_is_listed():
    text = README.read_text()
    assert [name for name in POLICIES.names() if f"`{name}`" not in text] == []


def test_the_python_example_runs(tiny_checkpoint, capsys):
    example = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    model = tiny_checkpoint("mixtral", num_layers=2)
    exec(compile(example.replace("path/to/checkpoint", str(model)), "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) >= 2 and "disk" in printed[-1]
