"""raypipe installs under a distribution name of its own: `raypipe` on the package index is an
unrelated project, so `pip install raypipe` (or a runtime_env naming it) would install that."""

import importlib.metadata
import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
NAME = "raypipe-train"


def test_the_distribution_is_raypipe_train_and_provides_the_package_and_command():
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"] == NAME
    dist = importlib.metadata.distribution(NAME)
    scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    assert scripts == {"raypipe": "raypipe.cli:main"}


def test_the_readme_never_tells_anyone_to_install_the_other_raypipe():
    readme = (ROOT / "README.md").read_text()
    assert "never `pip install raypipe`" in readme
    readme = readme.replace("never `pip install raypipe`", "")
    assert not re.search(r"pip install (-U |--upgrade )?['\"]?raypipe\b(?!-train)", readme)
    assert '"pip": ["raypipe"' not in readme
    assert "py_modules" in readme and "working-dir" in readme
