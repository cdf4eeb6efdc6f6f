"""Each setting is declared once: one field holds its default (and help, bounds); a config that repeats
it refers to that field (`same_as`, `default_of`), and a command's flags are generated from the fields
(moestream.settings). Finds a setting declared twice: as two fields of the settings dataclasses, as a
literal that repeats a shared setting's default (a field, a keyword default, an argparse default), or as
a flag with a default written by hand."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

import moestream
from moestream.cli import build_parser
from moestream.settings import flag_of

PACKAGE = Path(moestream.__file__).parent
SETTINGS_MODULES = ("config", "store.config", "parallel.config", "bench.sim.config", "bench.sim.ranks",
                    "bench.tools.compare", "predictors.configs", "bench.commands.sim", "cli.train_predictor",
                    "bench.policies")
HOMONYMS = {  # one name, two settings: each declared once
    "seed": "the moe-beyond pool's refill (SimConfig) and training's initialisation (TrainConfig)",
    "batch_size": "sequences per simulated iteration (SimConfig) and tokens per training minibatch (TrainConfig)",
    "num_threads": "threads that compute (EngineConfig) and torch's threads while training (TrainConfig)",
    "link_gbps": "the planner's modelled disk link (EngineConfig) and an override of the cost model's (CostOverrides)",
}
# modules that repeated a shared setting's default (issue 47): the settings' own and those that pass them on
SOURCES = ("config.py", "store/config.py", "parallel/config.py", "bench/sim/config.py", "bench/sim/ranks.py",
           "bench/tools/compare.py", "bench/commands/sim.py", "cli/train_predictor.py", "cli/generate.py", "cli/serve.py",
           "policies/driver.py", "bench/policies.py")
COMMANDS = (["sim"], ["train-predictor"], ["bench", "policies"])


def _settings_classes() -> list[type]:
    """Every dataclass of the settings modules with a flag (help text) or named *Config."""
    found = []
    for name in SETTINGS_MODULES:
        module = importlib.import_module(f"moestream.{name}")
        found += [cls for cls in vars(module).values() if isinstance(cls, type) and dataclasses.is_dataclass(cls)
                  and cls.__module__ == module.__name__ and (cls.__name__.endswith("Config")
                                                             or any("help" in f.metadata for f in dataclasses.fields(cls)))]
    return found


def _declarations() -> dict[str, list[str]]:
    """Setting name -> the classes declaring a default of it (not referring to another field's)."""
    declared = defaultdict(list)
    for cls in _settings_classes():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and "same_as" not in f.metadata:
                declared[f.name].append(cls.__name__)
    return declared


def _origins() -> set[tuple[type, str]]:
    """The settings that several configs hold, one declaring and the others referring: (declaring class, name)."""
    return {f.metadata["same_as"] for cls in _settings_classes() for f in dataclasses.fields(cls)
            if "same_as" in f.metadata and f.name not in HOMONYMS}


def _shared() -> dict[str, object]:
    """Name -> default of each setting that several configs hold."""
    return {name: cls.__dataclass_fields__[name].default for cls, name in _origins()}


def test_each_setting_is_declared_in_one_field():
    twice = {name: classes for name, classes in _declarations().items() if len(classes) > 1 and name not in HOMONYMS}
    assert not twice, f"settings declared in several fields (refer with same_as/default_of): {twice}"


def test_homonyms_are_still_distinct_settings():
    declared = _declarations()
    assert all(len(declared[name]) > 1 for name in HOMONYMS), "a homonym left: drop it from HOMONYMS"


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _literal  # not a literal


def _repeats(tree: ast.AST, shared: dict[str, object]) -> list[str]:
    """Literals in tree that repeat a shared setting's default: fields, keyword defaults, argparse defaults."""
    found = []

    def seen(name, node, line):
        if name in shared and _literal(node) is not _literal and _literal(node) == shared[name]:
            found.append(f"{name} = {ast.unparse(node)} (line {line})")

    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "setting" and value.args:
                value = value.args[0]
            seen(node.target.id, value, node.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args
            pairs = zip(args[len(args) - len(node.args.defaults):], node.args.defaults)
            for arg, default in [*pairs, *zip(node.args.kwonlyargs, node.args.kw_defaults)]:
                if default is not None:
                    seen(arg.arg, default, node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            keywords = {k.arg: k.value for k in node.keywords}
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            if flags and "default" in keywords:
                dest = _literal(keywords["dest"]) if "dest" in keywords else flags[0][2:].replace("-", "_")
                seen(dest, keywords["default"], node.lineno)
    return found


def _source_declares(path: str) -> list[str]:
    """The literals of moestream/path that repeat a shared setting, but its declaration where that is."""
    repeats = _repeats(ast.parse((PACKAGE / path).read_text()), _shared())
    module = "moestream." + path.removesuffix(".py").replace("/", ".")
    for cls, name in _origins():
        declaration = next((r for r in repeats if r.startswith(f"{name} = ")), None)
        if cls.__module__ == module and declaration is not None:
            repeats.remove(declaration)
    return repeats


@pytest.mark.parametrize("path", [*SOURCES, "bench/decision_cost.py"])
def test_no_literal_repeats_a_shared_setting(path):
    repeats = _source_declares(path)
    assert not repeats, f"moestream/{path} repeats a setting declared elsewhere: {repeats}"


def _flags_with_defaults(argv: list[str]) -> list:
    parser = build_parser(argv)
    for word in argv:
        parser = next(a for a in parser._actions if a.dest in ("command", "bench_kind")).choices[word]
    return [a for a in parser._actions if a.option_strings and a.default is not None and a.default is not False
            and a.default != [] and a.default != argparse.SUPPRESS]


def _generated(action) -> bool:
    """The flag is a settings field's: its flag, destination, default and help."""
    for cls in _settings_classes():
        for f in dataclasses.fields(cls):
            if "help" in f.metadata and flag_of(f) in action.option_strings and action.dest == f.name:
                shown = f.metadata["shown"](f.default) if "shown" in f.metadata else f.default
                if action.default == shown and action.help == f.metadata["help"]:
                    return True
    return False


@pytest.mark.parametrize("argv", COMMANDS, ids=["sim", "train-predictor", "bench-policies"])
def test_every_flag_with_a_default_is_generated_from_its_field(argv):
    by_hand = [a.option_strings[-1] for a in _flags_with_defaults(argv) if not _generated(a)]
    assert not by_hand, f"{' '.join(argv)}: flags written by hand, not from a settings field: {by_hand}"
