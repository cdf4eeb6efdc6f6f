"""A registry of named plugin classes. Mechanism code looks plugins up here, never by if/elif on names."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Callable, Generic, TypeVar

from moestream.errors import UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorate(cls: type[T]) -> type[T]:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._classes[name] = cls
            cls.registry_name = name
            return cls

        return decorate

    def get(self, name: str) -> type[T]:
        if name not in self._classes:
            known = ", ".join(sorted(self._classes)) or "none"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._classes[name]

    def create(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes


def import_submodules(package: ModuleType) -> None:
    """Import every module of a plugin package so that its classes register themselves."""
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
