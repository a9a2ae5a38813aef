"""Gang placement: a trainer's actors are reserved all or nothing in one Ray placement group, so two
trainers on a cluster that fits one never each hold half; the refused one holds nothing, fails in
time, and nothing leaks."""

import threading
import time

import pytest
import ray
from torch import nn

from raypipe import ConfigError, PlacementError, TrainConfig, Trainer

from helpers import MLP7, batch

SGD = {"name": "sgd", "lr": 0.05}


def groups(run_name: str) -> list[str]:
    return [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == f"raypipe-{run_name}"]


def free_cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def all_cpus_free(timeout: float = 20.0) -> float:
    """Waits until every CPU of the local Ray is free (killed actors of earlier tests release theirs
    asynchronously); returns their count."""
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + timeout
    while free_cpus() != total and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_cpus() == total, f"{free_cpus()} of {total} CPUs free: an earlier test still holds some"
    return total


def test_two_trainers_that_do_not_both_fit_start_at_once_and_one_trains(ray_session):
    """The local Ray has 2 CPUs; each trainer asks for 2 x 0.75. Started together, one gets both
    of its actors, the other none: it fails within its start timeout, naming the other trainer."""
    before = all_cpus_free()
    results: dict[str, object] = {}

    def start(name: str) -> None:
        try:
            results[name] = Trainer(
                MLP7,
                nn.functional.mse_loss,
                # the timeout bounds the winner's start too (2 actors importing torch on 2 cores: ~3 s alone)
                TrainConfig(pp=2, cpus_per_actor=0.75, actor_start_timeout=8, optimizer=SGD, name=name),
            )
        except PlacementError as error:
            results[name] = error

    threads = [threading.Thread(target=start, args=(name,)) for name in ("gang-a", "gang-b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)  # both ended: the loser at its start timeout
    trainers = [r for r in results.values() if isinstance(r, Trainer)]
    errors = [r for r in results.values() if isinstance(r, PlacementError)]
    assert len(trainers) == 1 and len(errors) == 1, results
    winner, error = trainers[0], str(errors[0])
    try:
        assert "all or nothing" in error and "not all at once now" in error and "'CPU': 0.75" in error
        assert free_cpus() == pytest.approx(before - 1.5)  # the refused trainer holds nothing
        loser = ({"gang-a", "gang-b"} - {winner.run_name}).pop()
        assert groups(loser) == ["REMOVED"] and groups(winner.run_name) == ["CREATED"]
        winner.step(*batch(0))
    finally:
        winner.shutdown()
    assert groups(winner.run_name) == ["REMOVED"]
    deadline = time.monotonic() + 10
    while free_cpus() != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert free_cpus() == before  # nothing leaked: the loser can train now
    with Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=0.75, optimizer=SGD, name=loser)) as t:
        assert t.step(*batch(0))["loss"] > 0


def test_a_waiting_trainer_holds_nothing_and_strict_spread_needs_a_node_per_actor(ray_session):
    """With 1 CPU free, a trainer asking for 2 x 0.75 could place one actor of two; reserved all
    or nothing it places none while it waits."""
    all_cpus_free()
    with Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=0.5, optimizer=SGD)) as holder:
        seen = []
        watcher = threading.Thread(target=lambda: [seen.append(free_cpus()) or time.sleep(0.2) for _ in range(10)])
        watcher.start()
        with pytest.raises(
            PlacementError, match=r"not all at once now.*still hold actors: " + r"Trainer\(run='" + holder.run_name
        ):
            Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=0.75, actor_start_timeout=2))
        watcher.join(timeout=10)
        assert seen and all(cpus == pytest.approx(1.0) for cpus in seen), seen  # never one actor of two
    with pytest.raises(
        PlacementError,
        match=r"placement='strict_spread'.*each of the 2 actors on a node of its own, "
        r"and 1 are alive",
    ):
        Trainer(
            MLP7,
            nn.functional.mse_loss,
            TrainConfig(pp=2, cpus_per_actor=0.25, actor_start_timeout=2, placement="strict_spread"),
        )
    with pytest.raises(ConfigError, match=r"TrainConfig.placement='scatter'"):
        TrainConfig(placement="scatter")


def test_a_new_actor_waits_for_the_name_of_one_just_killed(ray_session):
    """A recovery creates actors under the names of those it has just killed; Ray frees a name only
    once its GCS has seen the actor die (seen once in a full test run). `placement.created` waits."""
    from raypipe.driver.cluster.placement import created

    @ray.remote(num_cpus=0)
    class Named:
        def ping(self) -> str:
            return "up"

    taken = {"tries": 0}

    def make():
        taken["tries"] += 1
        if taken["tries"] < 3:  # as Ray answers while the old actor is still registered
            raise ray.exceptions.ActorAlreadyExistsError("The name stage0-dp0-tp0 is already taken")
        return Named.options(name="just-killed", namespace="gang-names").remote()

    actor = created(make)
    assert ray.get(actor.ping.remote(), timeout=30) == "up" and taken["tries"] == 3
    ray.kill(actor)
    again = created(lambda: Named.options(name="just-killed", namespace="gang-names").remote())
    assert ray.get(again.ping.remote(), timeout=30) == "up"
    ray.kill(again)
    with pytest.raises(ray.exceptions.ActorAlreadyExistsError):
        created(lambda: (_ for _ in ()).throw(ray.exceptions.ActorAlreadyExistsError("taken")), wait=0.2)
