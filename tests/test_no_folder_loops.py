"""No folder loop: no two sub-packages of moestream/ import each other (issue 47).

The graph is read statically from every module of moestream/ with `ast`: an edge from sub-package A to
sub-package B for each import of moestream.B... in a module under moestream/A/, counting imports inside
functions and those under `if TYPE_CHECKING:` (a type-only import is still a dependency of the layering).
Module-level cycles are tests/test_imports.py's, as is "no product module imports moestream.bench or
moestream.cli".
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) of every absolute import of moestream in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "moestream" else []
            found += [(node.lineno, name) for name in names or [node.module]]
    return [(line, name) for line, name in found if name.startswith("moestream.")]


def package_edges(root: Path) -> dict[tuple[str, str], str]:
    """(A, B) -> one import line of moestream/A/ that imports moestream.B, for sub-packages A != B."""
    package = root / "moestream"
    subpackages = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    edges = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root)
        source = rel.parts[1]
        if source not in subpackages:
            continue
        for line, name in imports(path):
            target = name.split(".")[1]
            if target in subpackages and target != source:
                edges.setdefault((source, target), f"{rel}:{line}: imports {name}")
    return edges


def loops(edges: dict[tuple[str, str], str]) -> list[str]:
    return [f"{a} <-> {b}: {edges[a, b]}; {edges[b, a]}" for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_loops_names_both_directions():
    edges = {("a", "b"): "moestream/a/x.py:3: imports moestream.b.y",
             ("b", "a"): "moestream/b/y.py:9: imports moestream.a",
             ("a", "c"): "moestream/a/z.py:1: imports moestream.c"}
    assert loops(edges) == ["a <-> b: moestream/a/x.py:3: imports moestream.b.y; moestream/b/y.py:9: imports moestream.a"]


def test_no_two_subpackages_import_each_other():
    found = loops(package_edges(ROOT))
    assert not found, "sub-packages that import each other:\n" + "\n".join(found)


def test_the_graph_reads_the_package():
    edges = package_edges(ROOT)
    assert ("bench", "policies") in edges and ("checkpoint", "quant") in edges  # the simulator drives policies
