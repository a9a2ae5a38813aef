"""The README's Python examples use only names they (or an earlier example) define or import,
so a newcomer who copies one does not meet a NameError."""

import builtins
import re
import symtable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


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


def test_every_readme_example_defines_what_it_uses():
    blocks = python_blocks()
    assert len(blocks) >= 4
    defined = set(dir(builtins))
    for number, code in enumerate(blocks, 1):
        missing = free_names(code) - defined
        assert not missing, f"README python example {number} uses undefined names {sorted(missing)}:\n{code}"
        top = symtable.symtable(code, "<readme>", "exec")
        defined |= {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
