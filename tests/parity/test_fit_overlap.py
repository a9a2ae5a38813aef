"""Trainer.fit keeps the next step queued at the actors while it waits for the current
one: the results are those of one step at a time, a failed step halts the step queued
behind it, and a fit stopped early books the step that already ran. With
`TrainConfig.actor_steps` the actors drive runs of steps themselves: the same results, the same
failures, checkpoints written at their steps, and a fit stopped early ends the run at a step."""

import pytest
import torch
from torch import nn

from raypipe import ConfigError, NonFiniteError, StageError, TrainConfig, Trainer
from raypipe.checkpoint.layout import list_checkpoints

from helpers import MLP7, assert_close_dicts, batch, reference_run

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def trainer(ray_session):
    t = Trainer(
        MLP7, nn.functional.mse_loss, TrainConfig(pp=2, microbatches=4, optimizer=SGD, seed=3, cpus_per_actor=0.25)
    )
    yield t
    t.shutdown()


def restart(trainer: Trainer, actor_steps: int | str = 0) -> None:
    """Back to the initial weights, a fresh optimizer and step 0 (and steps driven as told)."""
    if trainer.config.actor_steps != actor_steps:
        trainer.reconfigure(actor_steps=actor_steps)
    trainer.reset_optimizer()
    trainer.load_state_dict(reference_run(MLP7, 3, sgd, steps=0)[2])
    trainer.step_count = 0


def test_queued_steps_train_exactly_like_single_steps(trainer):
    restart(trainer)
    singles = [trainer.step(*batch(k))["loss"] for k in range(4)]
    expected = trainer.state_dict()
    restart(trainer)
    order = []

    def data(k):
        order.append(f"batch {k}")
        return batch(k)

    history = trainer.fit(data, 4, on_step=lambda m: order.append(f"done {m['step']}"), overlap=True)
    # the next batch was sent before the step ahead of it was booked
    assert order == ["batch 0", "batch 1", "done 1", "batch 2", "done 2", "batch 3", "done 3", "done 4"]
    assert [m["loss"] for m in history] == singles
    actual = trainer.state_dict()
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    assert all(0 < m["step_time"] < 60 for m in history)


def test_fit_with_on_step_waits_for_each_step_unless_told(trainer):
    restart(trainer)
    order = []

    def data(k):
        order.append(f"batch {k}")
        return batch(k)

    trainer.fit(data, 2, on_step=lambda m: order.append(f"done {m['step']}"))
    assert order == ["batch 0", "done 1", "batch 1", "done 2"]


@pytest.mark.parametrize(
    "spoil, error",
    [
        (lambda x: torch.randn(16, 5), StageError),  # 5 features where the first layer takes 6
        (lambda x: x * float("nan"), NonFiniteError),
    ],
    ids=["stage-error", "non-finite"],
)
@pytest.mark.parametrize("actor_steps", [0, 4], ids=["driver", "actors"])
def test_a_failed_step_halts_the_step_queued_behind_it(trainer, spoil, error, actor_steps):
    """Driven by the actors, the run's steps after the failed one are never run."""
    restart(trainer, actor_steps)
    trainer.fit(batch, 1)
    before = trainer.state_dict()

    def data(k):
        x, y = batch(k)
        return (spoil(x), y) if k == 1 else (x, y)

    with pytest.raises(error):
        trainer.fit(data, 4)  # step 2 (index 1) fails while step 3 is queued behind it
    assert trainer.step_count == 1
    after = trainer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    trainer.fit(batch, 3)  # and training goes on from the last good step
    assert trainer.step_count == 3
    assert_close_dicts(trainer.state_dict(), reference_run(MLP7, 3, sgd, steps=3)[2])


def test_a_fit_stopped_by_its_batches_books_the_step_already_queued(trainer):
    restart(trainer)

    def data(k):
        if k == 2:
            raise ValueError("no batch 2")
        return batch(k)

    with pytest.raises(ValueError, match="no batch 2"):
        trainer.fit(data, 4)
    assert trainer.step_count == 2  # step 2 was queued when batch 2 failed: it ran, so it counts
    assert_close_dicts(trainer.state_dict(), reference_run(MLP7, 3, sgd, steps=2)[2])


def test_actor_driven_runs_train_exactly_like_single_steps(trainer, tmp_path):
    """Runs of 3 steps over a fit of 7: the same losses and weights as one step at a time, the
    batches made by a reader actor (the driver never calls the function), each due checkpoint
    written by the actors inside the run, and the last step's timeline measured."""
    restart(trainer)
    singles = [trainer.step(*batch(k))["loss"] for k in range(7)]
    expected = trainer.state_dict()
    restart(trainer, actor_steps=3)
    trainer.reconfigure(checkpoint_dir=str(tmp_path), checkpoint_every=2)
    called = []

    def data(k):
        called.append(k)  # in the reader actor's process: not this list
        return batch(k)

    try:
        history = trainer.fit(data, 7)
    finally:
        trainer.reconfigure(checkpoint_dir=None, checkpoint_every=0)
    assert called == []
    assert [m["loss"] for m in history] == singles
    assert [m["step"] for m in history] == list(range(1, 8)) and all(m["samples"] == 16 for m in history)
    actual = trainer.state_dict()
    assert all(torch.equal(actual[k], expected[k]) for k in expected)
    assert [p.name for p in list_checkpoints(tmp_path)][-3:] == ["step-00000002", "step-00000004", "step-00000006"]
    assert [h["checkpoint"].endswith("step-00000004") for h in history if "checkpoint" in h] == [False, True, False]
    assert {span.stage for span in trainer.timeline().spans} == {0, 1}
    trainer.load(str(tmp_path), step=4, log=lambda line: None)  # the actors' checkpoint holds step 4's weights
    assert_close_dicts(trainer.state_dict(), reference_run(MLP7, 3, sgd, steps=4, microbatches=4)[2])


def test_a_fit_stopped_by_its_caller_ends_the_actors_run_at_a_step(trainer):
    """on_step raising in step 2 of a 20-step run: the actors are told to stop, end after the step
    under way, and every step they applied is booked; training then goes on exactly."""
    restart(trainer, actor_steps=20)

    def stop(metrics):
        if metrics["step"] == 2:
            raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        trainer.fit(batch, 20, on_step=stop)
    stopped = trainer.step_count
    assert 2 <= stopped < 20
    assert_close_dicts(trainer.state_dict(), reference_run(MLP7, 3, sgd, steps=stopped, microbatches=4)[2])
    trainer.fit(batch, stopped + 2)
    assert_close_dicts(trainer.state_dict(), reference_run(MLP7, 3, sgd, steps=stopped + 2, microbatches=4)[2])
    with pytest.raises(ConfigError, match="an iterable of batches is read on the driver"):
        trainer.fit(iter([batch(0)]), trainer.step_count + 1)
    with pytest.raises(ConfigError, match="actor-driven runs use the p2p engine"):
        TrainConfig(actor_steps=2, engine="compiled")
    restart(trainer)


def test_auto_hands_the_actors_long_fits_that_nothing_watches_between_steps(trainer, monkeypatch):
    """actor_steps="auto" (the default): a fit of enough steps x actors (here 100 x 2) without
    on_step is driven by the actors (the driver never calls the function), with the same losses
    and weights as the driver's steps; the trainer's reader is kept for its next fit, its batches
    freed when a fit ends. The driver steps where on_step needs each step booked before the
    next (overlap off), where a fit is short, and where the function cannot be sent to the
    reader (said)."""
    import threading

    import ray

    from raypipe.driver.run import actor_runs

    monkeypatch.setattr(actor_runs, "AUTO_ACTOR_STEPS", 200)  # 3000 by default: 1500 steps here
    called = []

    def data(k):
        called.append(k)  # in the driver's process only
        return batch(k)

    restart(trainer, "auto")
    trainer.fit(lambda k: batch(k + 1), 100)
    reader = trainer.group.reader
    assert ray.get(reader.__ray_call__.remote(lambda self: len(self.kept)), timeout=30) == 0  # freed when fit ends
    restart(trainer, "auto")
    by_actors = trainer.fit(data, 100)
    assert called == [] and trainer.group.reader is reader
    weights = trainer.state_dict()
    restart(trainer, "auto")
    by_driver = trainer.fit(data, 100, on_step=lambda metrics: None)
    assert called == list(range(100))
    assert [m["loss"] for m in by_driver] == [m["loss"] for m in by_actors]  # old batches were forgotten
    assert all(torch.equal(v, weights[k]) for k, v in trainer.state_dict().items())
    trainer.fit(data, 105)
    assert called[100:] == list(range(100, 105))
    lock, lines = threading.Lock(), []

    def locked(k):
        with lock:
            return data(k)

    trainer.fit(locked, 205, log=lines.append)
    assert called[105:] == list(range(105, 205))
    assert any("the driver submits each step" in line and "could not be sent" in line for line in lines), lines
    restart(trainer)


def test_the_reader_hands_actors_small_parts_inline_and_large_ones_by_reference(ray_session):
    """A run's actors take their batch parts from the reader's answer itself when small (one
    object-store fetch less per step: fed by a function, the 2-actor step took 6.5 ms with every
    part stored, 3.8 ms with them inline); a large part goes through the object store once."""
    import ray

    from raypipe.actors.io.reader import INLINE_BYTES, DatasetReader

    for rows, stored in ((8, False), (INLINE_BYTES // 32, True)):
        x = torch.randn(rows, 8)
        reader = DatasetReader(None, 0, None, 1, 2, nn.functional.mse_loss, function=lambda k: (x + k, x))
        made = reader.batches(0, 2, (1, 2))
        assert len(made) == 2 and all(isinstance(m.packed[0][0], ray.ObjectRef) == stored for m in made), made
        assert reader.batch(1) is not made[1]  # the driver's copy: by reference whatever its size
        assert isinstance(reader.batch(1).packed[0][0], ray.ObjectRef)
