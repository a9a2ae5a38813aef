"""Ray Tune: a raypipe trainer inside each trial, its actors reserved with the trial.

    from ray import tune
    import raypipe.tune

    def train_fn(params):
        config = TrainConfig(pp=2, cpus_per_actor=1, optimizer={"name": "adamw", "lr": params["lr"]})
        with Trainer(layers, loss_fn, config) as trainer:
            trainer.fit(batches, 100, on_step=raypipe.tune.report)

    tuner = tune.Tuner(raypipe.tune.trainable(train_fn, TrainConfig(pp=2, cpus_per_actor=1)),
                       param_space={"lr": tune.grid_search([1e-3, 3e-3])},
                       tune_config=tune.TuneConfig(metric="loss", mode="min"))

`trainable` is `tune.with_resources(train_fn, resources(config))`, after joining Ray as a Trainer
does and shipping `train_fn`'s module to the workers when it is not installed (a script's
neighbour). `resources` is the trial's placement-group factory: the trial function's own bundle, then one
bundle per actor with its CPUs and its accelerator kind's resources, so Tune starts a trial only
when all of its pipeline fits, and a Trainer built inside the trial starts its actors in those
bundles instead of reserving a group of its own (`raypipe.driver.cluster.gang.enclosing`). When Tune ends
a trial its actors end with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from raypipe.config import TrainConfig
from raypipe.driver.cluster.gang import STRATEGIES
from raypipe.observe.loggers import scalars

if TYPE_CHECKING:
    from ray.tune import PlacementGroupFactory

REPORTED = ("step", "loss", "lr", "grad_norm", "step_time", "samples_per_s", "tokens_per_s")


def resources(config: TrainConfig, trial_cpus: float = 0.25) -> PlacementGroupFactory:
    """The `tune.PlacementGroupFactory` for trials that each run a trainer with `config`'s
    topology: `trial_cpus` for the trial function (the trainer's driver, which mostly waits), then
    each actor's bundle (its stage's accelerator, and `config.cpus_per_actor`; when that is unset,
    a share of the cluster's CPUs as a Trainer takes it, so one trial fills the cluster), placed by
    `config.placement`. The trainer's config inside the trial must ask for the same topology and
    devices; its actors take their bundles' CPUs."""
    import ray
    from ray.tune import PlacementGroupFactory

    from raypipe.driver.cluster.placement import actor_bundles
    from raypipe.driver.cluster.topology import Topology

    topology = Topology(config.pp, config.dp, config.tp, config.ep)
    count = len(topology.names())
    cpus = config.cpus_per_actor
    if cpus is None:
        spare = ray.cluster_resources().get("CPU", 1.0) - trial_cpus if ray.is_initialized() else count
        cpus = max(0.01, min(1.0, int(100 * spare / count) / 100))
    actors = [b for b, _ in actor_bundles(config, topology, cpus)]
    return PlacementGroupFactory([{"CPU": trial_cpus}, *actors], strategy=STRATEGIES[config.placement])


def trainable(
    train_fn: Callable[[dict[str, object]], object], config: TrainConfig, trial_cpus: float = 0.25
) -> Callable[[dict[str, object]], object]:
    """`train_fn` as a Tune trainable whose trials each reserve a trainer's actors for `config`
    (`resources`). Joins `RAY_ADDRESS`'s cluster, or starts the embedded local Ray, when Ray is not
    running yet (as `Trainer` does), so Tune uses the same one."""
    from ray import tune

    from raypipe.driver import connect, ship_user_code

    connect()
    ship_user_code([train_fn])
    return tune.with_resources(train_fn, resources(config, trial_cpus))


def report(metrics: Mapping[str, object]) -> None:
    """Reports a step's metrics to the Tune trial (`Trainer.fit(..., on_step=raypipe.tune.report)`):
    step, loss, lr, grad_norm, step_time, throughput, and every scalar the loggers record
    (`raypipe.observe.loggers.scalars`: train/..., stage{s}/...). Also takes your own dict (`{"val_loss": v}`)."""
    from ray import tune

    values = {key: metrics[key] for key in REPORTED if key in metrics}
    if "stages" in metrics:
        values.update(scalars(metrics))
    values.update({k: v for k, v in metrics.items() if k not in values and isinstance(v, (int, float))})
    tune.report(values)
