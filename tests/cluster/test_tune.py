"""Ray Tune: a 2-trial learning-rate sweep of the tiny job (pp = 2) on the local Ray, each trial a
whole pipeline started in the bundles its trial reserved, and the best trial read back."""

import signal
import sys
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from raypipe import PlacementError, TrainConfig  # noqa: E402


@pytest.fixture(scope="module")
def results(ray_session, tmp_path_factory):
    import tune_lr

    earlier = set(ray.util.placement_group_table())  # groups of the session's earlier tests
    ctrl_c = signal.getsignal(signal.SIGINT)
    grid = tune_lr.sweep(
        str(ROOT / "examples" / "configs" / "tiny.yaml"),
        [0.01, 1e-5],
        steps=12,
        storage=str(tmp_path_factory.mktemp("tune")),
        trial_cpus=0.25,
        overrides=("cpus_per_actor=0.25", "threads_per_actor=1", "data.val_fraction=0"),
    )
    grid.groups = [g for pid, g in ray.util.placement_group_table().items() if pid not in earlier]
    grid.ctrl_c = (ctrl_c, signal.getsignal(signal.SIGINT))  # before the sweep, after it
    return grid


def test_both_trials_train_and_report_every_step(results):
    assert not results.errors, results.errors
    assert len(results) == 2
    for result in results:
        frame = result.metrics_dataframe
        assert list(frame["step"]) == list(range(1, 13))
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "stage0/forward_s", "stage1/bubble_fraction"} <= set(frame)
        assert frame["lr"].iloc[-1] == pytest.approx(result.config["lr"])


def test_the_sweep_leaves_ctrl_c_as_it_found_it(results):
    """Tune's own SIGINT handler outlived a sweep and swallowed the next Ctrl-C of the process (a
    later test's, in the full suite): the example puts the previous handler back."""
    before, after = results.ctrl_c
    assert after is before, after


def test_the_best_trial_is_the_learning_rate_that_trains(results):
    best = results.get_best_result(scope="last-5-avg")
    assert best.config["lr"] == 0.01
    by_lr = {r.config["lr"]: r.metrics_dataframe["loss"] for r in results}
    # lr 1e-5 barely moves from the first loss; lr 0.01 learns (the tiny job's loss falls by > 0.5 in 12 steps)
    assert by_lr[0.01].iloc[-1] < by_lr[0.01].iloc[0] - 0.5
    assert abs(by_lr[1e-5].iloc[-1] - by_lr[1e-5].iloc[0]) < 0.2


def test_the_trainers_reserved_no_group_of_their_own_and_left_nothing(results):
    """The trainers started their actors in the bundles their trials reserved: none reserved a
    group of its own (which would have waited beside the trials' reservations), and once Tune
    ended the trials every CPU is free again (no actor or group left)."""
    import time

    assert len(results.groups) == 2  # the two trials' own
    assert not [g["name"] for g in results.groups if g["name"].startswith("raypipe-")]
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0.0) == ray.cluster_resources()["CPU"]


def test_a_trial_whose_group_lacks_the_actors_bundles_is_told_how_to_reserve_them(ray_session):
    """A trainer built inside a placement group without bundles for its actors refuses to start,
    naming `raypipe.tune.trainable`."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 0.25}])
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=0.25)
    def build():
        from torch import nn

        from raypipe import LayerSpec, Trainer

        try:
            Trainer([LayerSpec(nn.Linear, 2, 2)] * 2, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=0.25))
        except PlacementError as error:
            return str(error)
        return "started"

    try:
        message = ray.get(
            build.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
            ).remote(),
            timeout=120,
        )
    finally:
        remove_placement_group(group)
    assert "inside a placement group (a Ray Tune trial's) of 1 bundles" in message
    assert "raypipe.tune.resources(config)" in message or "raypipe.tune.trainable" in message
