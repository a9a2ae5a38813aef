"""What keeps the tree tidy runs in the suite, so CI keeps it: ruff's lint and format check
(configured in pyproject.toml), and the mutation check's bugs still finding the code they break."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RUFF = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(RUFF is None, reason="ruff is installed by `make install` (the test extra)")
@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    done = subprocess.run([RUFF, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


def test_every_mutation_still_finds_its_code_exactly_once():
    """`benchmarks/mutation_check.py` replaces one exact piece of source per bug; after a refactor
    a piece that no longer occurs, or a mutant that no longer compiles, would test nothing."""
    import mutations

    lost = {m.name: (ROOT / m.path).read_text().count(m.old) for m in mutations.MUTATIONS}
    assert {name: n for name, n in lost.items() if n != 1} == {}
    for m in mutations.MUTATIONS:  # a mutant that does not even compile would test nothing
        compile((ROOT / m.path).read_text().replace(m.old, m.new), m.path, "exec")
    assert all((ROOT / t.split("::")[0]).exists() for m in mutations.MUTATIONS for t in m.tests)
