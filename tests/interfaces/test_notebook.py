"""examples/notebook.ipynb run headless in a real Jupyter kernel by nbconvert's executor (what
`jupyter nbconvert --to notebook --execute` runs, with the kernel the notebook names), then its
cells run again in the same kernel, as a person re-running cells would: no leaked actors, no name
clashes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parents[2]


def outputs_text(cell):
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts += [str(v) for v in out.get("data", {}).values()]
    return "\n".join(parts)


def test_notebook_runs_and_reruns_in_one_kernel(tmp_path, monkeypatch, fork_env):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the kernel starts its own local Ray
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # checkpoints land under tmp_path/runs
    nb = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    build = next(i for i in code if "trainer = Trainer(" in nb.cells[i].source)
    client = ExecutePreprocessor(timeout=240)
    client.nb, client.resources = nb, {"metadata": {"path": str(tmp_path)}}
    client.kernel_name = nb.metadata.kernelspec.name  # as the command line does
    with client.setup_kernel(env={**os.environ, "PYTHONWARNINGS": "default", **fork_env}):
        for i in code[:-1]:
            client.execute_cell(nb.cells[i], i)
        first_pass = {i: outputs_text(nb.cells[i]) for i in code}
        for i in [j for j in code[:-1] if j >= build]:  # run the trainer cells again
            client.execute_cell(nb.cells[i], i)
        client.execute_cell(nb.cells[code[-1]], code[-1])

    texts = {i: outputs_text(nb.cells[i]) for i in code}
    assert "Trainer(run='notebook', pp=2" in first_pass[build]
    assert "shutting down the running trainer named 'notebook'" in texts[build]  # the re-run replaced it
    curve = next(i for i in code if "LossCurve(history)" in nb.cells[i].source and "reconfigure" in nb.cells[i].source)
    assert "<svg" in texts[curve] and "loss per step" in texts[curve]
    line = [l for l in texts[curve].splitlines() if l.startswith("loss ")][0]
    first, last = float(line.split()[1]), float(line.split()[3])
    assert last < first - 1.0, line
    timeline = next(i for i in code if "trainer.timeline()" in nb.cells[i].source)
    assert "<svg" in texts[timeline] and "stage1-dp0-tp0" in texts[timeline]
    actors = next(i for i in code if "list_actors" in nb.cells[i].source)
    assert "live stage actors: ['stage0-dp0-tp0', 'stage1-dp0-tp0']" in texts[actors]  # after the re-run too
    saving = next(i for i in code if "trainer.save(" in nb.cells[i].source)
    assert re.search(r"saved runs/notebook/[0-9a-f]{8}/step-00000050 in /", texts[saving]), texts[saving]
    assert str(tmp_path) in texts[saving]  # where it went, in full
    command = [str(Path(sys.executable).parent / "jupyter"), "nbconvert", "--help"]
    assert "--execute" in subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    assert "shut down)" in texts[code[-1]]
    # what a person does by hand: one step's metrics, a held-out loss, where the step's time went,
    # the stages, a sample, a checkpoint loaded back (weights and step as saved)
    one = next(i for i in code if "trainer.step(*batches(0))" in nb.cells[i].source)
    assert "'loss':" in texts[one] and "'tokens_per_s':" in texts[one] and "'bubble':" in texts[one]
    assert "a warm-up step" in texts[one]  # its bubble is not read as the pipeline's
    held = next(i for i in code if "trainer.evaluate(" in nb.cells[i].source)
    assert re.search(r"held-out loss \d+\.\d+ at step 30", texts[held]), texts[held]
    assert "busiest actor's actions" in texts[timeline]
    stages = next(i for i in code if "stage_info()" in nb.cells[i].source)
    assert "stage0-dp0-tp0 layers" in texts[stages] and "cpu" in texts[stages]
    sample = next(i for i in code if "trainer.generate(" in nb.cells[i].source)
    printed = "".join(o.get("text", "") for o in nb.cells[sample].outputs)  # a slow one's bar aside
    assert printed.startswith("def ") and len(printed) > 20, texts[sample]
    loaded = next(i for i in code if "trainer.load(" in nb.cells[i].source)
    assert "step 50, weights as saved: True" in texts[loaded], texts[loaded]
    assert "runs no step" not in "".join(texts.values())  # the re-run continued: never 0 steps silently
