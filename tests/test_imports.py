"""The package's import graph: no cycles, and torch only where something trains or runs a torch model.

The graph is read statically from every module of moestream/ with `ast`, counting imports inside
functions too (a lazy import that closes a loop is still a cycle), but not those under
`if TYPE_CHECKING:`. The torch-free checks import modules in a fresh interpreter.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moestream"
TORCH_FREE = (
    "moestream.policies",
    "moestream.contracts",
    "moestream.policies.driver",
    "moestream.policies.baselines",
    "moestream.bench.sim.bounds",
    "moestream.policies.designs",
    "moestream.policies.default",
    "moestream.bench.sim",
    "moestream.bench.tools.compare",
    "moestream.bench.sim.ranks",
    "moestream.parallel.placement",
    "moestream.bench.tools.prediction",
    "moestream.trace.recorder",
)


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The moestream modules that path imports (each `from X import Y` resolves to X.Y or X)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {_resolve(name, known) for name in found if name.startswith("moestream")} - {None}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of nodes, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_find_cycle_finds_a_cycle_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles_in_the_package():
    known = module_names()
    graph = {name: imported(path, known) - {name} for name, path in known.items()}
    assert find_cycle(graph) is None


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_product_module_imports_the_lab_or_the_command_line():
    """The lab (moestream.bench) and the command line (moestream.cli, and __main__ that starts it) sit above the
    product: no other module imports either."""
    known = module_names()
    above = ("moestream.bench", "moestream.cli", "moestream.__main__")
    below = {name: path for name, path in known.items() if not name.startswith(above)}
    found = {name: sorted(m for m in imported(path, known) if m.startswith(above)) for name, path in below.items()}
    assert {name: up for name, up in found.items() if up} == {}
