"""From the flat keywords a config has always taken (`TrainConfig(pp=2, microbatches=4)`) and whole
sections (`parallel=ParallelConfig(pp=2)` or `parallel={"pp": 2}`) to the nine sections."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

from raypipe.config.sections import SECTION_OF, SECTION_TYPES, SECTIONS, Section
from raypipe.core.errors import ConfigError, nearest


def build_sections(values: Mapping[str, object]) -> dict[str, Section]:
    """Each section, from its own value (a section, or a mapping of its fields) and the flat
    fields of it among `values`; raises ConfigError for an unknown name or a field given twice."""
    given: dict[str, object] = {}
    fields: dict[str, dict[str, object]] = {name: {} for name in SECTION_TYPES}
    for key, value in values.items():
        if key in SECTION_TYPES:
            given[key] = value
        elif key in SECTION_OF:
            fields[SECTION_OF[key]][key] = value
        else:
            names = (*SECTIONS, *SECTION_OF)
            raise ConfigError(
                f"unknown field {key!r}: TrainConfig has no such field or section.{nearest(str(key), names)}"
            )
    return {name: _section(kind, given.get(name), fields[name]) for name, kind in SECTION_TYPES.items()}


def _section(kind: type[Section], value: object, flat: dict[str, object]) -> Section:
    """Section `kind` from its value and its flat fields."""
    if value is None:
        return kind(**flat)
    if isinstance(value, kind):
        if flat:
            raise ConfigError(
                f"{', '.join(flat)} set both by name and in the whole section {kind.NAME}={value!r}: "
                f"set it in the section ({kind.__name__}(..., {next(iter(flat))}=...)), or give the fields by name."
            )
        return value
    if not isinstance(value, Mapping) or isinstance(value, Section):
        raise ConfigError(
            f"TrainConfig.{kind.NAME}={value!r} is invalid: give a {kind.__name__} or a mapping of its fields "
            f"({', '.join(kind.names())})."
        )
    for key in value:
        if key not in kind.names():
            where = (
                f" (a field of section {SECTION_OF[key]!r})" if key in SECTION_OF else nearest(str(key), kind.names())
            )
            raise ConfigError(f"unknown field {kind.NAME}.{key}: section {kind.NAME!r} has no field {key!r}{where}.")
        if key in flat:
            raise ConfigError(f"field {key!r} is set twice, by name and in section {kind.NAME!r}; keep one.")
    return kind(**value, **flat)


def config_signature() -> inspect.Signature:
    """`TrainConfig(...)`'s keywords as help() and a notebook's completion show them: every field by
    its flat name with its default, then the sections."""
    parameters = []
    for kind in SECTION_TYPES.values():
        for f in dataclasses.fields(kind):  # type: ignore[arg-type]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            parameters.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default))
    for name, kind in SECTION_TYPES.items():
        parameters.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind.__name__)
        )
    return inspect.Signature(parameters)
