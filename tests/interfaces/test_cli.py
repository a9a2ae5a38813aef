"""The command line and the main job, run as a user runs them (subprocesses, own embedded Ray)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tensorboard_run

ROOT = Path(__file__).resolve().parents[2]
RAYPIPE = [sys.executable, "-m", "raypipe.cli"]


def run(args, env, timeout=240):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def losses(output):
    return [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", output)]


def test_examples_train_py_with_overrides_on_pp1_dp2_tp2(clean_env):
    result = run(
        [
            sys.executable,
            "examples/train.py",
            "--config",
            "examples/configs/tiny.yaml",
            "--set",
            "pp=1",
            "--set",
            "dp=2",
            "--set",
            "tp=2",
            "--set",
            "schedule=gpipe",
            "--set",
            "job.steps=10",
            "--set",
            "job.sample_tokens=0",
        ],
        clean_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pp=1, dp=2, tp=2, schedule=gpipe" in result.stdout
    assert "stages: stage0-dp0-tp0 layers [0, 4)" in result.stdout
    assert (
        "actors: 4 = pp 1 x dp 2 x tp 2: stage0-dp0-tp0, stage0-dp0-tp1, stage0-dp1-tp0, stage0-dp1-tp1"
        in result.stdout
    )
    assert "step   10 | loss" in result.stdout


def test_bad_config_is_a_clear_error_with_exit_code_2(clean_env):
    result = run(RAYPIPE + ["train", "examples/configs/tiny.yaml", "--set", "microbatch=4"], clean_env)
    assert result.returncode == 2
    assert "unknown field 'microbatch'" in result.stderr and "Did you mean 'microbatches'" in result.stderr
    result = run([sys.executable, "examples/train.py", "--config", "nope.yaml"], clean_env)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_plan_and_schedule_commands(clean_env):
    result = run(RAYPIPE + ["plan", "examples/configs/gpt_pp2.yaml"], clean_env)
    assert result.returncode == 0, result.stderr
    assert "6 layers" in result.stdout and "stage 1: layers [3, 6)" in result.stdout
    result = run(RAYPIPE + ["schedule", "1f1b", "--pp", "3", "-m", "4"], clean_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("stage 0: 0F0 0F1 0F2")
    assert "peak (chunk) microbatches in flight per actor: [3, 2, 1]" in result.stdout
    result = run(RAYPIPE + ["plan", "examples/configs/gpt_pp2.yaml", "--set", "schedule=zb-v"], clean_env)
    assert result.returncode == 0, result.stderr
    assert "virtual stage 3 (stage 0): layers [" in result.stdout and "virtual stage 1 (stage 1)" in result.stdout
    result = run(RAYPIPE + ["schedule", "zb-v", "--pp", "2", "-m", "4"], clean_env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("stage 0: 0F0 0F1 0F2 3F0 3I0 3W0")
    assert "virtual stages per actor: [[0, 3], [1, 2]]" in result.stdout


def test_raypipe_train_runs_the_job_saves_checkpoints_and_resumes_on_another_topology(clean_env, tmp_path):
    ck = tmp_path / "ck"
    common = ["--set", f"checkpoint_dir={ck}", "--set", "checkpoint_every=20", "--set", "data.val_fraction=0"]
    common += ["--set", f"log_dir={tmp_path / 'tb'}"]
    first = run(RAYPIPE + ["train", "examples/configs/tiny.yaml", "--set", "job.steps=40"] + common, clean_env)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    # the embedded Ray turned token authentication on, as it should: raypipe does not print Ray's notice of it
    assert "Token authentication is enabled" not in out + first.stderr, first.stderr[-3000:]
    assert "stages: stage0-dp0-tp0 layers [0, 2), stage1-dp0-tp0 layers [2, 4)" in out
    # the long phases say what they do in a log with no terminal; the first step is marked warm-up
    assert "raypipe: starting 2 actors ..." in out and re.search(r"raypipe: 2 actors started in [\d.]+ s", out)
    # and which ports the actors' world listens on, per node (issue 75); no rendezvous port among them
    listens = r"raypipe: the actors' world listens on [\d.]+: stage0-dp0-tp0 \d+.*, stage1-dp0-tp0 \d+.*; its"
    assert re.search(listens, out), out[:3000]
    assert re.search(r"step    1 \|.*\| warm-up\n", out) and not re.search(r"step   (5|10) \|.*warm-up", out)
    # the README shows the first run's output: each of its lines, up to its figures and paths, is printed
    shown = (ROOT / "README.md").read_text().split("```text\n", 1)[1].split("\nsample:", 1)[0]
    for line in shown.splitlines():
        # a step queued behind the one before began before the driver's clock: its breakdown says no
        # "step N ms =" (`StepBreakdown.step_ms`), which the README's run happened to have
        head = re.split(r"[\d/]", re.sub(r"step [\d.]+ ms = ", "", line), maxsplit=1)[0]
        if line != "..." and "val loss" not in line:
            assert any(printed.startswith(head) for printed in out.splitlines()), f"README shows {line!r}"
    assert "tok/s" in out and "sample:" in out
    assert re.search(r"the last step: (step [\d.]+ ms = )?[\d.]+ busiest actor's actions \+ [\d.]+ the schedule's", out)
    values = losses(out)
    assert len(values) >= 5 and values[-1] < values[0] - 1.0
    assert f"saved {ck}/step-00000040" in out
    second = run(
        RAYPIPE
        + [
            "train",
            "examples/configs/tiny.yaml",
            "--set",
            "job.steps=25",
            "--resume-step",
            "20",
            "--set",
            "pp=1",
            "--set",
            "job.sample_tokens=0",
        ]
        + common,
        clean_env,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {ck}/step-00000020 at step 20" in second.stdout
    # the resumed run (on another topology) repeats the first run's step 25 loss
    first_25 = re.search(r"step   25 \| loss (\d+\.\d+)", out).group(1)
    assert f"step   25 | loss {first_25}" in second.stdout
    # TensorBoard: the resumed run continued its run's folder, from its checkpoint's step on
    (folder,) = (tmp_path / "tb").iterdir()
    events = tensorboard_run(folder)
    losses_25 = [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")]
    assert [step for step, _ in losses_25] == list(range(1, 26))  # the first run's 21..40 purged
    assert losses_25[-1][1] == pytest.approx(float(first_25), abs=1e-4)
    missing = run(
        RAYPIPE + ["train", "examples/configs/tiny.yaml", "--resume", "--set", f"checkpoint_dir={tmp_path / 'none'}"],
        clean_env,
    )
    assert missing.returncode == 2 and "no valid checkpoint" in missing.stderr
