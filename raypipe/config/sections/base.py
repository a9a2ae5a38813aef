"""What a section of `TrainConfig` is: a frozen dataclass of related fields (as torchtitan's
JobConfig nests its own), each field checked when the section is built, with its meaning in the
section's `Attributes:`. A section reads as a mapping too (`dict(config.parallel)`), and a flat
name (`Alias`) reads a section's field from the whole config (`config.pp` is `config.parallel.pp`)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Generic, TypeVar, overload

from raypipe.core.errors import nearest

T = TypeVar("T")
S = TypeVar("S", bound="Section")


class Section(Mapping[str, object]):
    """The behaviour every section shares; `section(name)` makes a class one."""

    NAME: ClassVar[str]  # the section's name: TrainConfig's attribute, a YAML file's key, the guide's column

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The section's field names, in the order the guide lists them."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def __getitem__(self, name: str) -> object:
        if name not in self.names():
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __getattr__(self, name: str) -> object:
        """Only for a name the section lacks (a field is found before this is asked)."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"section {self.NAME!r} has no field {name!r}; its fields: {', '.join(self.names())}."
            f"{nearest(name, self.names())}"
        )

    def normalise(self, name: str, value: object) -> None:
        """Sets a field to its checked form while the section is being built (a list for a tuple)."""
        object.__setattr__(self, name, value)

    def with_values(self: S, **values: object) -> S:
        """A copy with some fields set to values the config's cross-section checks made (a per-stage
        list), not checked again."""
        made = copy.copy(self)
        for name, value in values.items():
            object.__setattr__(made, name, value)
        return made


def refuse_change(self: object, name: str, value: object = None) -> None:
    """A config's `__setattr__`: it is read-only, and the error says how to change it."""
    raise AttributeError(
        f"a config is read-only ({type(self).__name__}.{name}): use config.replace({name}=...) for a changed copy, "
        "or Trainer.reconfigure on a running trainer."
    )


def section(name: str) -> Callable[[type[S]], type[S]]:
    """Makes `cls` the section `name`: a frozen dataclass of its fields, read-only with an error
    that says how to change one."""

    def make(cls: type[S]) -> type[S]:
        made = dataclasses.dataclass(frozen=True)(cls)
        made.NAME = name
        made.__setattr__ = refuse_change  # type: ignore[method-assign,assignment]
        made.__delattr__ = refuse_change  # type: ignore[method-assign,assignment]
        return made

    return make


class Alias(Generic[T]):
    """A flat name for a section's field: `config.pp` reads `config.parallel.pp`. The flat names are
    what `TrainConfig(pp=2)`, a YAML file's `pp: 2` and `--set pp=2` set, as before the sections."""

    def __init__(self, section_name: str) -> None:
        self.section = section_name
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Alias[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | Alias[T]:
        if obj is None:
            return self
        return getattr(obj.__dict__[self.section], self.name)

    def __set__(self, obj: object, value: T) -> None:
        refuse_change(obj, self.name)
