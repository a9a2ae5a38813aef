"""The README's and every guide's Python examples use only names they (or an earlier example of
the same page) define or import, so a newcomer who copies one does not meet a NameError; and the
configuration guide's table is the one `TrainConfig` itself makes."""

import builtins
import re
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def free_names(code: str) -> set[str]:
    """Global names that `code` reads but never binds (at module level or in any nested scope)."""
    top = symtable.symtable(code, "<readme>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (table is top or symbol.is_global()):
                used.add(symbol.get_name())
    return used - bound


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_example_defines_what_it_uses(page):
    blocks = python_blocks(page)
    defined = set(dir(builtins))
    for number, code in enumerate(blocks, 1):
        missing = free_names(code) - defined
        assert not missing, f"{page.name} python example {number} uses undefined names {sorted(missing)}:\n{code}"
        top = symtable.symtable(code, "<readme>", "exec")
        defined |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


def test_the_readme_is_short_and_links_every_guide():
    text = README.read_text()
    assert len(text.splitlines()) <= 250 and len(python_blocks()) >= 1
    guides = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert not {g for g in guides if f"docs/{g}" not in text}, "a guide the README does not link"


def test_the_configuration_guide_is_generated_from_trainconfig():
    from raypipe.config import TrainConfig, guide

    documented = guide.field_docs()
    assert [name for name in TrainConfig.field_names() if not documented.get(name)] == []
    assert set(documented) <= set(TrainConfig.field_names()), "a documented field that is gone"
    assert set(guide.RECONFIGURABLE) <= set(documented), "a reconfigurable field that is gone"
    text = guide.GUIDE.read_text()
    assert guide.rendered(text) == text, "docs/configuration.md is stale: python -m raypipe.config.guide"
