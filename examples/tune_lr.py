"""Sweeps the learning rate of a raypipe job with Ray Tune: every trial trains the whole pipeline.

    .venv/bin/python examples/tune_lr.py --config examples/configs/gpt_pp2.yaml --lrs 3e-4 1e-3 3e-3 --steps 100

Each trial runs the job (`raypipe.job.run`: the config's model, data and pp = 2 split) with
its own `optimizer.lr`, reporting every step to Tune (`raypipe.tune.report`). Its placement
group (`raypipe.tune.trainable`) holds the trial and every stage actor, so Tune starts a trial
only when its whole pipeline fits and runs as many side by side as the cluster holds. The best
trial is the one with the lowest mean loss over its last 10 steps.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path
from typing import Any

from ray import tune

import raypipe.tune
from raypipe.job import JobConfig
from raypipe.job import run as run_job


def trial(params: dict[str, Any]) -> None:
    """One Tune trial: the job with the trial's learning rate."""
    lr = params["lr"]
    config = JobConfig.from_yaml(params["config"], [*params["overrides"], f"optimizer.lr={lr}"])
    run_job(config, log=lambda line: print(f"[lr {lr:g}] {line}"), on_metrics=raypipe.tune.report)


def sweep(
    config: str, lrs: list[float], steps: int, storage: str, overrides: tuple[str, ...] = (), trial_cpus: float = 0.25
) -> tune.ResultGrid:
    """Runs one trial per learning rate on the connected (or a new local) Ray; returns Tune's results."""
    path = str(Path(config).resolve())  # trials run in their own working directories
    overrides = (*overrides, f"job.steps={steps}", "job.progress=false", "job.sample_tokens=0")
    train = JobConfig.from_yaml(path, overrides).train
    tuner = tune.Tuner(
        raypipe.tune.trainable(trial, train, trial_cpus),
        param_space={"lr": tune.grid_search(lrs), "config": path, "overrides": list(overrides)},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(name="lr-sweep", storage_path=str(Path(storage).resolve()), verbose=0),
    )
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1)}
    try:
        return tuner.fit()
    finally:
        # Tune installs its own Ctrl-C handler and leaves it after a sweep that ends normally
        # (ray.tune.tune._setup_signal_catching): the next Ctrl-C in this process, a notebook's stop
        # button while a Trainer trains, would only set Tune's stale flag. Put the previous ones back.
        for s, handler in before.items():
            if handler is not None:
                signal.signal(s, handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="examples/configs/gpt_pp2.yaml")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--storage", default="runs/tune", help="where Tune keeps the trials' results")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides for every trial, e.g. --set cpus_per_actor=0.5",
    )
    args = parser.parse_args()
    results = sweep(args.config, args.lrs, args.steps, args.storage, tuple(args.overrides))
    for result in sorted(results, key=lambda r: r.config["lr"]):
        losses = result.metrics_dataframe["loss"].tail(10)
        print(f"lr {result.config['lr']:g}: mean loss of the last {len(losses)} steps {losses.mean():.4f}")
    best = results.get_best_result(scope="last-10-avg")
    print(f"best lr {best.config['lr']:g} (results in {best.path})")


if __name__ == "__main__":
    main()
