"""Where a job's outputs go: relative paths (checkpoint_dir, log_dir, exports) that survive the job.

`ray job submit --working-dir .` runs the job inside Ray's unpacked copy of the directory
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash>/`), a new one whenever a file of it
changes: a relative `checkpoint_dir` written there is out of the user's sight, and lost to the
next submission's `--resume`. So a job's relative output paths resolve against one durable
place, the same for every submission: `RAYPIPE_RUNS_DIR` when set, else `~/raypipe-runs` inside
such a copy, else the working directory (a job run where it was started, as always). The job
prints where.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from raypipe.checkpoint.storage import is_uri
from raypipe.config import TrainConfig
from raypipe.core import env

PACKAGES = "working_dir_files"  # the folder of Ray's runtime resources holding unpacked working dirs


def base() -> tuple[Path, str]:
    """The directory relative output paths resolve against, and why that one."""
    given = env.runs_dir()
    if given is not None:
        return given, "RAYPIPE_RUNS_DIR"
    here = Path.cwd()
    if PACKAGES in here.parts:
        return Path.home() / "raypipe-runs", "a ray job's working-dir copy (set RAYPIPE_RUNS_DIR to choose)"
    return here, "the working directory"


def resolve(path: str | None, root: Path) -> str | None:
    """`path` against `root` when it is a relative local path; as it is otherwise (None, absolute, a URI)."""
    if path is None or is_uri(path) or os.path.isabs(str(path)):
        return path
    return str(root / path)


def durable(train: TrainConfig, job: Any) -> tuple[TrainConfig, Any, Path, str]:
    """The job's TrainConfig and job settings with their relative output paths resolved (`base`),
    that base, and why it was chosen."""
    import dataclasses

    root, why = base()
    train = train.replace(checkpoint_dir=resolve(train.checkpoint_dir, root), log_dir=resolve(train.log_dir, root))
    job = dataclasses.replace(
        job, save_pretrained=resolve(job.save_pretrained, root), save_adapter=resolve(job.save_adapter, root)
    )
    return train, job, root, why


def watch_lines(run_name: str, log_dir: str | None) -> list[str]:
    """What a job prints as it starts, for a person to find the run: its name (its actors' Ray
    namespace), the Ray dashboard's address, and the TensorBoard command for its log_dir."""
    lines = [f"raypipe: run {run_name} (its actors are in Ray namespace raypipe-{run_name})"]
    try:
        import ray

        url = ray._private.worker._global_node.webui_url  # None where the dashboard is off
        if url:
            lines.append(
                f"raypipe: Ray dashboard http://{url.removeprefix('http://')} (Actors: filter by that namespace)"
            )
    except Exception:  # noqa: BLE001 - a driver connected without a local node knows no address
        pass
    if log_dir is not None:
        lines.append(f"raypipe: TensorBoard: tensorboard --logdir {log_dir} (a folder per run in it)")
    from raypipe.observe import grafana

    placed = grafana.install()  # on the head: Ray's Grafana provisioning shows it beside Ray's dashboards
    if placed is not None:
        lines.append(
            f"raypipe: Grafana dashboard 'raypipe' in {placed.parent} (docs/watching.md: Prometheus and Grafana)"
        )
    return lines
