"""Every environment variable raypipe reads, in one place, with its default."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """RAYPIPE_CACHE_DIR: where built corpora are cached (default ~/.cache/raypipe)."""
    return Path(os.environ.get("RAYPIPE_CACHE_DIR", Path.home() / ".cache" / "raypipe"))


def runs_dir() -> Path | None:
    """RAYPIPE_RUNS_DIR: where a job's relative output paths (checkpoint_dir, log_dir, exports)
    resolve; unset: the working directory, except inside a `ray job submit --working-dir` copy,
    where `~/raypipe-runs` (`raypipe.driver.outputs`)."""
    value = os.environ.get("RAYPIPE_RUNS_DIR")
    return Path(value).expanduser() if value else None


def ray_address() -> str | None:
    """RAY_ADDRESS: the cluster to join; unset means start an embedded local Ray."""
    return os.environ.get("RAY_ADDRESS") or None


def preload_modules() -> list[str]:
    """RAYPIPE_PRELOAD=MODULES: what the idle worker processes of a Ray that raypipe starts import
    before they take work (Ray's `preload_python_modules`), comma-separated, e.g.
    "torch,raypipe.actors.stage_actor"; unset or empty: nothing. A stage actor started in such a worker
    skips ~2.5 s of imports, but Ray keeps one idle worker per CPU, each ~130 MB larger (measured
    unique memory), and does not prestart more once they are used: off by default."""
    value = os.environ.get("RAYPIPE_PRELOAD", "")
    return [m.strip() for m in value.split(",") if m.strip()]


def call_timeout() -> float:
    """RAYPIPE_CALL_TIMEOUT=SECONDS: how long the driver waits for its actors to finish a call that
    is not a training step (save, load, configure, stage_info, state_dict, export) before it names
    the actors still at it and gives up (default 600; steps use TrainConfig.step_timeout)."""
    return float(os.environ.get("RAYPIPE_CALL_TIMEOUT") or 600.0)


def fake_accelerator() -> str | None:
    """RAYPIPE_FAKE_ACCELERATOR=KIND:COUNT:MODEL (e.g. `cuda:2:NVIDIA-H100`): makes `detect()` report
    that accelerator instead of this machine's, so tests and demos can start Ray nodes that advertise
    cuda, rocm or mps on a CPU-only machine. Unset (the default): detect the real hardware."""
    return os.environ.get("RAYPIPE_FAKE_ACCELERATOR") or None


def trace_path() -> str | None:
    """RAYPIPE_TRACE=PATH: the engines append every call they issue there, as JSON lines
    (`raypipe.driver.trace`). Unset (the default): no trace."""
    return os.environ.get("RAYPIPE_TRACE") or None


def gradient_hand_on() -> str:
    """When a stage's whole backward sends its input gradient (`Executor.may_hand_on_early`), read on
    the driver when a trainer starts or reconfigures:

    - "measured" (the default): before its weight gradients on a chunk where the split backward
      costs no more than the whole one, as each actor measures it in its first steps
      (`raypipe.actors.step.hand_on`);
    - "early" (RAYPIPE_EARLY_GRADIENTS=1): always before them, unmeasured;
    - "late" (RAYPIPE_LATE_GRADIENTS=1, which wins): after them, as torch.distributed.pipelining's
      schedules do.

    The two variables are for measuring what sending early gains
    (`benchmarks/vs_torch_pipelining.py --late-gradients`) and for tests."""
    if os.environ.get("RAYPIPE_LATE_GRADIENTS", "") not in ("", "0"):
        return "late"
    if os.environ.get("RAYPIPE_EARLY_GRADIENTS", "") not in ("", "0"):
        return "early"
    return "measured"


# RAYPIPE_ACCELERATOR: set by raypipe itself in each stage or profiler process to the kind it
# serves (`raypipe.core.devices.serving_kind`); not for users to set.
SERVING_ENV = "RAYPIPE_ACCELERATOR"
