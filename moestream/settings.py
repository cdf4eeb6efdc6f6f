"""Settings declared once: a dataclass field carries its default, help text and bounds; this module turns
such a dataclass into argparse flags and the parsed flags back into the dataclass.

`setting(default, help)` becomes the flag --field-name (or `flag`); a bool is a switch that flips its
default; `parse(text, flag)` reads a flag's text; a field whose default_factory is a dataclass nests.
Errors name the flag. This module knows no particular setting; the dataclasses know no argparse.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, Field, field, fields, is_dataclass

from moestream.errors import MoestreamError


def setting(default, help: str, **meta) -> Field:
    """A field with its flag's help text and metadata: flag, short (a one-letter alias), parse, minimum,
    above, metavar, choices, type (of a flag whose default is None), shown (the default's text in a flag)."""
    return field(default=default, metadata=meta | {"help": help})


def same_as(cls, name: str, **meta) -> Field:
    """A field repeating `cls`'s setting `name` (default, bounds; `meta` replacing them), noted as `same_as`."""
    declared = cls.__dataclass_fields__[name]
    return field(default=declared.default, metadata=dict(declared.metadata) | meta | {"same_as": (cls, name)})


def default_of(cls, name: str):
    """The default of `cls`'s field `name`: a keyword default that repeats a setting refers to it."""
    return cls.__dataclass_fields__[name].default


def check(config) -> None:
    """Refuses a field below its `minimum` or not above its `above`, naming the field."""
    for f in fields(config):
        value, least, above = getattr(config, f.name), f.metadata.get("minimum"), f.metadata.get("above")
        if least is not None and not value >= least:
            raise MoestreamError(f"{f.name} must be >= {least}, got {value}")
        if above is not None and not value > above:
            raise MoestreamError(f"{f.name} must be > {above}, got {value}")


def flag_of(f: Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                  only: tuple[str, ...] | None = None) -> None:
    """Adds a flag for each setting of `cls` (and those it nests), but those in skip, or only those in `only`."""
    for f in fields(cls):
        if _nested(f):
            add_arguments(parser, f.default_factory, skip, only)
        elif "help" in f.metadata and f.name not in skip and (only is None or f.name in only):
            _add(parser, f)


def read_flags(cls, args: argparse.Namespace) -> None:
    """Reads, in place, the flags of `cls` that a `parse` reads, refusing (naming the flag) before heavy imports."""
    for f in fields(cls):
        if _nested(f):
            read_flags(f.default_factory, args)
        elif "parse" in f.metadata and isinstance(getattr(args, f.name, None), str):
            setattr(args, f.name, f.metadata["parse"](getattr(args, f.name), flag_of(f)))


def from_args(cls, args: argparse.Namespace, **overrides):
    """The `cls` that the parsed flags describe (overrides win); a refusal names the flag."""
    read_flags(cls, args)
    values = {f.name: from_args(f.default_factory, args) if _nested(f) else getattr(args, f.name)
              for f in fields(cls) if _nested(f) or ("help" in f.metadata and hasattr(args, f.name))}
    try:
        return cls(**(values | overrides))
    except MoestreamError as error:
        raise type(error)(_name_flags(str(error), cls)) from None


def _nested(f: Field) -> bool:
    return f.default_factory is not MISSING and is_dataclass(f.default_factory)


def _add(parser: argparse.ArgumentParser, f: Field) -> None:
    meta, flag = f.metadata, flag_of(f)
    names = (meta["short"], flag) if "short" in meta else (flag,)
    if isinstance(f.default, bool):
        parser.add_argument(*names, dest=f.name, action="store_false" if f.default else "store_true", help=meta["help"])
        return
    kind = meta.get("type") or (None if "parse" in meta or f.default is None else type(f.default))
    default = meta["shown"](f.default) if "shown" in meta else f.default  # a text that `parse` reads back
    choices = meta.get("choices")
    parser.add_argument(*names, dest=f.name, default=default, type=kind, choices=choices, help=meta["help"],
                        metavar=meta.get("metavar") or (None if choices else flag[2:].upper().replace("-", "_")))


def _name_flags(message: str, cls) -> str:
    """The message with each flagged field's name replaced by its flag."""
    for f in fields(cls):
        if _nested(f):
            message = _name_flags(message, f.default_factory)
        elif "help" in f.metadata:
            message = re.sub(rf"\b{f.name}\b", flag_of(f), message)
    return message
