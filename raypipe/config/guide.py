"""The configuration guide's table of `TrainConfig` fields, made from the class itself: each
field in its section (`sections`), its meaning from its section's docstring (`Attributes:`), its
default from the section's dataclass, whether `Trainer.reconfigure` may change it from `RECONFIGURABLE`.
One source: a field documented nowhere else can never be documented wrongly elsewhere.

    python -m raypipe.config.guide            # rewrites the table in docs/configuration.md
    python -m raypipe.config.guide --check    # exits 1 when the guide is out of date
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from raypipe.config.sections import SECTION_TYPES, SECTIONS
from raypipe.config.validation import RECONFIGURABLE

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = "<!-- the table below is generated from TrainConfig: python -m raypipe.config.guide -->"
END = "<!-- end of the generated table -->"


def field_docs() -> dict[str, str]:
    """Field name -> its paragraph of its section's `Attributes:`, on one line."""
    docs: dict[str, list[str]] = {}
    for kind in SECTION_TYPES.values():
        name = None
        for line in (kind.__doc__ or "").split("Attributes:", 1)[-1].splitlines():
            entry = re.match(r"^ {8}(\w+): (.*)$", line)
            if entry:
                name = entry.group(1)
                docs[name] = [entry.group(2)]
            elif name and line.startswith(" " * 12):
                docs[name].append(line.strip())
    return {k: " ".join(v) for k, v in docs.items()}


def default_of(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return "none" if value is None else f"`{value!r}`".replace("|", "\\|")


def table() -> str:
    """The markdown table, one row per field in its section's order (`SECTIONS`): section, field,
    default, reconfigurable, meaning."""
    docs = field_docs()
    fields = {f.name: f for kind in SECTION_TYPES.values() for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    rows = ["| section | field | default | reconfigure | meaning |", "|---|---|---|---|---|"]
    for section, names in SECTIONS.items():
        for name in names:
            meaning = docs.get(name, "").replace("|", "\\|")
            again = "yes" if name in RECONFIGURABLE else ""
            rows.append(f"| {section} | `{name}` | {default_of(fields[name])} | {again} | {meaning} |")
    return "\n".join(rows)


def rendered(text: str) -> str:
    """`text` (the guide) with its generated block replaced by the current table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n\n" + table() + "\n\n" + text[end:]


def main(argv: list[str]) -> int:
    text = GUIDE.read_text()
    if "--check" in argv:
        if rendered(text) != text:
            print(f"{GUIDE} is out of date: run python -m raypipe.config.guide", file=sys.stderr)
            return 1
        return 0
    GUIDE.write_text(rendered(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
