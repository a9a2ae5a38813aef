"""`make` on a machine whose Python cannot make a virtual environment (a fresh Debian or
Ubuntu without python3-venv) stops with the one line that fixes it, and creates nothing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_without_python3_venv_prints_the_fix(tmp_path):
    shadow = tmp_path / "shadow" / "ensurepip"  # as Debian's python3 without python3-venv: no ensurepip
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named ensurepip')\n")
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    result = subprocess.run(
        ["make", "--no-print-directory", "install", f"VENV={venv}", f"PYTHON={sys.executable}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sudo apt-get install python3-venv" in errors[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not venv.exists()
