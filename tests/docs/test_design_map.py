"""docs/design.md is a true map of the code: short, every name in it exists, its diagram shows every room,
and the README points a newcomer at it and at the two guides near its top.

Which backticked spans are checked (inline `code` outside fenced blocks), and how:

- a span with a space is a command or an expression. One that starts with `moestream`, or with a
  command (a module or package of moestream/cli, e.g. `bench fidelity`), must name a command, and
  after `bench` a kind (one of moestream/bench, tools/ excepted); other such spans are not checked.
- in every span, each `--flag` must be declared by the package: the literal "--flag" in its source,
  or a field or name `flag_with_underscores` there (settings generate flags from fields).
- a span with a `/`, or ending in .py, .md or .sh, is a path: from the repository root when it starts
  with moestream/, tests/, docs/ or scripts/, else from moestream/ (.md: from docs/). It must exist.
  An upper-case segment (`families/TYPE.py`) is a placeholder and must match at least one path.
- `moestream.a.b[.Name...]`: the longest prefix that is a module is imported, the rest got by getattr.
- a code name is a chain of identifiers (`Name`, `module.Name`, `Class.method`, with an optional
  trailing call `(...)`) that has a dot, an upper-case letter or an underscore. Its first identifier is
  a name the package defines (found statically in moestream/, then its module imported and the name
  got by getattr), or a module (`store.factory`, a module's own name such as `derive`, or an
  installed package such as `torch`). Each later identifier is an attribute: getattr, a dataclass
  field or annotation, or an attribute a method of the class (or of a base) sets on self.
- a lower-case word, hyphens and digits allowed (`lru`, `moe-beyond`, `fit`), is a name some
  registry of the package holds or a name the package defines.
- anything else (a value such as `share:F`, a shape such as `[T * K, H]`) is not checked.

Markdown links to files must point at files that exist. The page has at most 2,500 words (split on
white space, the diagram and tables included) and answers a newcomer's questions by name. The diagram
(the page's first fenced block) must name every room: each folder of moestream/ with an __init__.py
as `name/`, each top-level module but __init__.py as `name.py`; each `name/` or `name.py` it shows must
exist under moestream/. The README links the page and the two guides in its first 40 lines.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moestream"
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
MAX_WORDS = 2500
README_TOP_LINES = 40
GUIDES = ("docs/design.md", "docs/adding-a-policy.md", "docs/adding-a-family.md")
QUESTIONS = ("Where a transfer is admitted", "Where bytes move", "Where a request is scheduled and admitted",
             "adding-a-policy.md", "adding-a-family.md")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
CHAIN = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(?:\(.*\))?$")
WORD = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
ROOTED = ("moestream/", "tests/", "docs/", "scripts/")


# -- the package, read statically --------------------------------------------------------------------

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def index() -> tuple[dict, dict, set]:
    """(top-level names: name -> modules defining it, class members: (module, class) -> member names,
    every name defined anywhere)."""
    top: dict[str, set[str]] = {}
    members: dict[tuple[str, str], set[str]] = {}
    everywhere: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        tree = ast.parse(path.read_text())
        for node in tree.body:
            for name in _defined(node):
                top.setdefault(name, set()).add(module)
        for node in ast.walk(tree):
            everywhere.update(_defined(node))
            if isinstance(node, ast.ClassDef):
                found = set()
                for inner in node.body:
                    found.update(_defined(inner))
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                        targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                        for target in targets:
                            for t in ast.walk(target):
                                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                        and t.value.id in ("self", "cls")):
                                    found.add(t.attr)
                members.setdefault((module, node.name), set()).update(found)
                everywhere.update(found)
    return top, members, everywhere


def _defined(node) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


@cache
def source_text() -> str:
    return "\n".join(path.read_text() for path in PACKAGE.rglob("*.py"))


@cache
def registered_names() -> frozenset[str]:
    from moestream.registry import Registry

    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "Registry(" not in path.read_text():
            continue
        module = _import(module_name(path))
        for value in vars(module).values():
            if isinstance(value, Registry):
                names.update(value.names())
    return frozenset(names)


@cache
def _import(name: str):
    module = importlib.import_module(name)
    if name in ("moestream.policies", "moestream.families", "moestream.quant", "moestream.bench.sim"):
        return module
    for package in ("moestream.policies", "moestream.families", "moestream.quant", "moestream.bench.sim"):
        if name.startswith(package + "."):  # its registry fills as the package imports every module
            importlib.import_module(package)
    return module


def _module(name: str):
    try:
        return _import(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):
            return None
        raise


# -- resolving one span ------------------------------------------------------------------------------

def has_attribute(obj, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    if not isinstance(obj, type):
        return False
    _, members, _ = index()
    for cls in obj.__mro__:
        if attr in getattr(cls, "__dataclass_fields__", {}) or attr in getattr(cls, "__annotations__", {}):
            return True
        if attr in members.get((cls.__module__, cls.__name__), ()):
            return True
    return False


def _walk(obj, rest: list[str]) -> bool:
    for attr in rest:
        if not has_attribute(obj, attr):
            return False
        obj = getattr(obj, attr, None)
        if obj is None:  # an attribute set on instances only: nothing further to walk
            return attr == rest[-1]
    return True


def resolves_chain(chain: str) -> bool:
    first, *rest = chain.split(".")
    top, members, _ = index()
    if first == "moestream" or (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file():
        dotted = chain if first == "moestream" else f"moestream.{chain}"
        return resolves_dotted(dotted)
    for module in sorted(top.get(first, ())):
        owner = _module(module)
        if owner is not None and hasattr(owner, first) and _walk(getattr(owner, first), rest):
            return True
    for (module, cls), names in members.items():  # a member named alone, or a member's attribute
        if first in names and not rest:
            owner = _module(module)
            if owner is not None and has_attribute(getattr(owner, cls), first):
                return True
    stems = sorted(module_name(p) for p in PACKAGE.rglob(f"{first}.py"))
    for module in stems:
        if rest and _walk(_module(module), rest):
            return True
    if not stems and first not in top and rest:
        try:
            return _walk(importlib.import_module(first), rest)
        except ImportError:
            return False
    return False


def resolves_dotted(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module(".".join(parts[:cut]))
        if module is not None:
            return _walk(module, parts[cut:])
    return False


def resolves_path(span: str) -> bool:
    span = span.split("#")[0].rstrip("/") or "/"
    base = ROOT if span.startswith(ROOTED) else ROOT / "docs" if span.endswith(".md") else PACKAGE
    if (base / span).exists():
        return True
    segments = [seg.partition(".") for seg in span.split("/")]
    if not any(stem.isupper() and len(stem) > 1 for stem, _, _ in segments):
        return False
    placeholder = lambda stem: "*" if stem.isupper() and len(stem) > 1 else stem  # noqa: E731
    pattern = "/".join(placeholder(stem) + dot + ext for stem, dot, ext in segments)
    return any(base.glob(pattern))


def flag_declared(flag: str) -> bool:
    name = flag[2:].replace("-", "_")
    return f'"{flag}"' in source_text() or f"'{flag}'" in source_text() or name in index()[2]


def is_command(word: str) -> bool:
    name = word.replace("-", "_")
    return (PACKAGE / "cli" / f"{name}.py").is_file() or (PACKAGE / "cli" / name).is_dir()


def command_exists(span: str) -> bool:
    """A command line: `moestream COMMAND ...` or `COMMAND ...`; after `bench`, a kind of moestream/bench."""
    words = span.split()[1:] if span.startswith("moestream ") else span.split()
    if not words or words[0].startswith("-") or words[0].isupper():
        return True
    if not is_command(words[0]):
        return False
    if words[0] == "bench" and len(words) > 1 and not words[1].startswith("-") and not words[1].isupper():
        kind = PACKAGE / "bench" / words[1].replace("-", "_")
        return kind.name != "tools" and (kind.with_suffix(".py").is_file() or kind.is_dir())
    return True


def problem(span: str) -> str | None:
    """Why the span names nothing that exists (None: it does, or it is not checked)."""
    span = span.strip()
    flags = [flag for flag in FLAG.findall(span) if not flag_declared(flag)]
    if flags:
        return f"flag {flags[0]} is declared nowhere in moestream/"
    if " " in span:
        commands = span.startswith("moestream ") or is_command(span.split()[0])
        return None if not commands or command_exists(span) else "no such command"
    if span.startswith("-"):
        return None
    if "/" in span or span.endswith((".py", ".md", ".sh")):
        return None if resolves_path(span) else "no such file or folder"
    if span.startswith("moestream."):
        return None if resolves_dotted(re.sub(r"\(.*\)$", "", span)) else "no such module or name"
    match = CHAIN.match(span)
    if match and ("." in span or "_" in span or any(c.isupper() for c in span)):
        return None if resolves_chain(match.group(1)) else "no such name"
    if WORD.match(span):
        known = span in registered_names() or (span.isidentifier() and span in index()[2])
        return None if known else "neither a registered name nor a name the package defines"
    return None


def code_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def stale(text: str) -> list[str]:
    """Each span of text that names nothing that exists, with why; then each broken link."""
    found = [f"`{span}`: {why}" for span in dict.fromkeys(code_spans(text)) if (why := problem(span))]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http") and not (DESIGN.parent / target).exists():
            found.append(f"link {target}: no such file")
    return found


def rooms() -> list[str]:
    """moestream's rooms: its folders with an __init__.py and its top-level modules but __init__.py."""
    folders = [p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    modules = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    return sorted(folders) + sorted(modules)


def diagram(text: str) -> str:
    return re.search(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M).group(1)


def missing_rooms(block: str) -> list[str]:
    return [room for room in rooms() if not re.search(rf"(?<![\w/.]){re.escape(room)}", block)]


def unknown_in_diagram(block: str) -> list[str]:
    shown = re.findall(r"(?<![\w/.])(\w+/|\w+\.py)(?!\w)", block)
    return [name for name in shown if not any(PACKAGE.rglob(name.rstrip("/")))]


# -- the page ---------------------------------------------------------------------------------------

def test_every_name_and_path_on_the_page_exists():
    assert stale(DESIGN.read_text()) == []


def test_the_page_has_at_most_2500_words():
    words = len(DESIGN.read_text().split())
    assert words <= MAX_WORDS, f"docs/design.md has {words} words"


def test_the_diagram_shows_every_room_and_only_what_exists():
    block = diagram(DESIGN.read_text())
    assert missing_rooms(block) == []
    assert unknown_in_diagram(block) == []


def test_the_page_answers_a_newcomers_questions():
    text = DESIGN.read_text()
    assert [question for question in QUESTIONS if question not in text] == []


def test_the_readme_links_the_map_and_the_guides_near_its_top():
    top = "\n".join(README.read_text().splitlines()[:README_TOP_LINES])
    assert [guide for guide in GUIDES if f"]({guide})" not in top] == []


# -- the checks themselves -------------------------------------------------------------------------

def test_a_planted_stale_name_is_found():
    planted = ("Misses are admitted by `_make_room` and `TransferCore._drop_worst`, "
               "bandwidth in `moestream/store/bandwidth.py` and `moestream.store.bandwidth`, "
               "the workloads' `serving.workload.TRACE_READERS`, `moestream bench streaming`, `bench ranked --x`, "
               "the `--no-such-flag` flag and the `no-such-policy` policy.")
    found = stale(planted)
    for name in ("_make_room", "TransferCore._drop_worst", "moestream/store/bandwidth.py",
                 "moestream.store.bandwidth", "serving.workload.TRACE_READERS", "moestream bench streaming",
                 "bench ranked --x", "--no-such-flag", "no-such-policy"):
        assert any(f"`{name}`" in line for line in found), name


def test_names_that_exist_pass():
    fine = ("`TransferCore.fetch_layer` (`moestream/transfer_core.py`), `store/store.py` `ExpertStore`, "
            "`moestream.registry.Registry`, `Registry.register(name)`, `EngineConfig.device`, "
            "`store.store.ExpertStore`, `registry.Registry`, `torch.where`, `lru`, `moe-beyond`, "
            "`families/TYPE.py`, `moestream sim --policy lru`, `share:F`, [simulator.md](simulator.md).")
    assert stale(fine) == []


def test_a_room_missing_from_the_diagram_is_found():
    block = diagram(DESIGN.read_text())
    assert missing_rooms(block.replace("store/", "")) == ["store/"]
    assert unknown_in_diagram(block + "\nno_such_room/\n") == ["no_such_room/"]
