"""The configuration guide's table of `TrainConfig` fields, made from the class itself: each
field's meaning from its docstring's `Attributes:` section, its default from the dataclass,
whether `Trainer.reconfigure` may change it from `RECONFIGURABLE`. One source: a field
documented nowhere else can never be documented wrongly elsewhere.

    python -m raypipe.config_docs            # rewrites the table in docs/configuration.md
    python -m raypipe.config_docs --check    # exits 1 when the guide is out of date
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from raypipe.config import TrainConfig
from raypipe.config_checks import RECONFIGURABLE

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- the table below is generated from TrainConfig: python -m raypipe.config_docs -->"
END = "<!-- end of the generated table -->"


def field_docs() -> dict[str, str]:
    """Field name -> its paragraph of `TrainConfig`'s `Attributes:` section, on one line."""
    section = TrainConfig.__doc__.split("Attributes:", 1)[1]
    docs: dict[str, list[str]] = {}
    name = None
    for line in section.splitlines():
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
    """The markdown table: field, default, reconfigurable, meaning."""
    docs = field_docs()
    rows = ["| field | default | reconfigure | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(TrainConfig):
        meaning = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default_of(f)} | {'yes' if f.name in RECONFIGURABLE else ''} | {meaning} |")
    return "\n".join(rows)


def rendered(text: str) -> str:
    """`text` (the guide) with its generated block replaced by the current table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n\n" + table() + "\n\n" + text[end:]


def main(argv: list[str]) -> int:
    text = GUIDE.read_text()
    if "--check" in argv:
        if rendered(text) != text:
            print(f"{GUIDE} is out of date: run python -m raypipe.config_docs", file=sys.stderr)
            return 1
        return 0
    GUIDE.write_text(rendered(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
