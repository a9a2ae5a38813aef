"""Ray Data input: `fit(dataset, steps, batch_size=...)` reads the dataset in a reader actor beside
the stages, so its batches never pass through the driver; the same losses as the same batches fed
by a function; exact continuation across a resume, an epoch boundary and an actor's death; and
iterables of batches."""

import os
import re

import numpy as np
import pytest
import ray
import torch
from torch import nn

from raypipe import BatchError, ConfigError, LayerSpec, TrainConfig, Trainer
from raypipe.checkpoint.layout import list_checkpoints

from helpers import MLP7, KillOnce

# 7 steps over 4 batches an epoch: step 5 starts the second epoch (and a replay that read ahead by a
# whole epoch would not look right by chance)
BATCH, EPOCH_BATCHES, STEPS = 16, 4, 7
ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
generator = torch.Generator().manual_seed(7)
X = torch.randn(BATCH * EPOCH_BATCHES, 6, generator=generator)
Y = torch.randn(BATCH * EPOCH_BATCHES, 3, generator=generator)


def batches(step):
    """The same batches as the dataset gives, step by step: rows in order, epoch after epoch."""
    k = step % EPOCH_BATCHES
    return X[k * BATCH : (k + 1) * BATCH], Y[k * BATCH : (k + 1) * BATCH]


def dataset():
    return ray.data.from_items([{"x": X[i].numpy(), "y": Y[i].numpy()} for i in range(len(X))], override_num_blocks=4)


def config(**changes):
    base = dict(pp=2, dp=2, microbatches=2, optimizer=ADAMW, seed=3, cpus_per_actor=0.25, threads_per_actor=1)
    base.update(changes)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def fed_by_function(ray_session):
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        return [m["loss"] for m in t.fit(batches, STEPS)]


def test_dataset_losses_equal_the_same_batches_fed_by_a_function(fed_by_function, monkeypatch):
    """...and the driver never cuts a batch: `prepare` fails if the driver process calls it. (Driven
    by the actors, the same losses: `test_a_stage_death_replays_the_same_batches[dataset-actors]`.)"""
    import raypipe.driver.feeds as feeds

    def driver_cut(*args, **kwargs):
        raise AssertionError("the driver cut a batch of the dataset")

    monkeypatch.setattr(feeds, "prepare", driver_cut)
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        history = t.fit(dataset(), STEPS, batch_size=BATCH)
    assert [m["loss"] for m in history] == pytest.approx(fed_by_function, rel=1e-6, abs=1e-7)
    assert [m["samples"] for m in history] == [BATCH] * STEPS


def test_ray_data_is_held_to_the_cpus_free_beside_the_actors_unless_the_dataset_says(ray_session):
    """Issue 60: no read task queued for a CPU the stage actors hold (a pending demand in Ray's
    status, and a request to the autoscaler), while a limit the user set stays theirs."""
    from raypipe.actors.io.reader import DatasetReader

    reader = DatasetReader(dataset(), BATCH, None, 1, 2, nn.functional.mse_loss, cpus=1.5)
    assert reader.dataset.context.execution_options.resource_limits.cpu == 1.5
    own = dataset()
    own.context.execution_options.resource_limits = own.context.execution_options.resource_limits.copy(cpu=3)
    reader = DatasetReader(own, BATCH, None, 1, 2, nn.functional.mse_loss, cpus=1.5)
    assert reader.dataset.context.execution_options.resource_limits.cpu == 3


def test_an_iterable_of_batches_gives_the_same_losses(fed_by_function):
    with Trainer(MLP7, nn.functional.mse_loss, config(engine="compiled")) as t:
        history = t.fit((batches(k) for k in range(STEPS)), STEPS)
    assert [m["loss"] for m in history] == pytest.approx(fed_by_function, rel=1e-6, abs=1e-7)


def test_a_resumed_run_reads_on_from_its_step_across_the_epoch_boundary(fed_by_function, tmp_path):
    with Trainer(MLP7, nn.functional.mse_loss, config(checkpoint_dir=str(tmp_path), checkpoint_every=2)) as t:
        t.fit(dataset(), 4, batch_size=BATCH)
    with Trainer(MLP7, nn.functional.mse_loss, config(pp=1, dp=1)) as t:  # another topology reads the same batches
        t.load(str(tmp_path))
        resumed = [m["loss"] for m in t.fit(dataset(), STEPS, batch_size=BATCH)]
    assert t.step_count == STEPS
    assert resumed == pytest.approx(fed_by_function[4:], rel=1e-5, abs=1e-6)


def killable(flag):
    return MLP7[:4] + [LayerSpec(KillOnce, str(flag))] + MLP7[4:]  # stage 1 holds the KillOnce layer


@pytest.fixture(scope="module")
def killable_by_function(ray_session, tmp_path_factory):
    with Trainer(killable(tmp_path_factory.mktemp("never") / "flag"), nn.functional.mse_loss, config()) as t:
        return [m["loss"] for m in t.fit(batches, STEPS)]


@pytest.mark.parametrize("source", ["dataset", "iterable", "dataset-actors"])
def test_a_stage_death_replays_the_same_batches(killable_by_function, tmp_path, source):
    """Stage 1 of a replica dies in step 6. From the checkpoint (the Dataset case,
    `restore_from_replicas=False`) the recovery restores step 4's and the feed gives steps 5..7
    again (step 5 ran already): a Ray Dataset re-read from its start. From the surviving replica's
    memory (the iterable case) step 6 runs again on the batch the feed kept; nothing is replayed.
    Driven by the actors (runs of 4 steps, ahead of the driver's booking), it dies in the step
    after the one the driver books second, and the run's checkpoints, written by the actors, restore."""
    flag = tmp_path / "kill-now"
    layers = killable(flag)
    messages = []
    memory = source == "iterable"
    driven = source == "dataset-actors"
    cfg = config(
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=2,
        max_restarts=1,
        restore_from_replicas=memory,
        actor_steps=4 if driven else 0,
    )
    with Trainer(layers, nn.functional.mse_loss, cfg) as t:

        def on_step(metrics):
            if metrics["step"] == (2 if driven else 5) and t.restarts == 0:
                flag.touch()  # stage 1 kills its own process in the next step's first forward

        data = (batches(k) for k in range(STEPS)) if memory else dataset()
        history = t.fit(data, STEPS, batch_size=BATCH, on_step=on_step, log=messages.append)
        assert t.restarts == 1
    if memory:
        assert any("resumed at step 5 from the surviving replicas" in m for m in messages), messages
        assert [m["step"] for m in history] == list(range(1, STEPS + 1)), messages
    elif driven:
        # both replicas' stage 1 hold the layer: the first to read the flag dies, whichever it is
        assert any(re.search(r"stage1-dp\d-tp0 died", m) for m in messages), messages
        assert any(f"resumed at step {s} from" in m for m in messages for s in (2, 4)), messages
    else:
        assert any("resumed at step 4 from" in m for m in messages), messages
    losses = {m["step"]: m["loss"] for m in history}
    assert [losses[s] for s in range(1, STEPS + 1)] == pytest.approx(killable_by_function, rel=1e-6, abs=1e-7)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")][-1] == "step-00000006"


def test_bad_datasets_and_arguments_are_refused_plainly(ray_session):
    with Trainer(MLP7, nn.functional.mse_loss, config(dp=1)) as t:
        renamed = ray.data.from_items([{"features": X[i].numpy(), "target": Y[i].numpy()} for i in range(32)])
        with pytest.raises(BatchError, match=r"columns are \['features', 'target'\].*collate="):
            t.fit(renamed, 1, batch_size=8)
        with pytest.raises(ConfigError, match="batch_size=None is invalid"):
            t.fit(dataset(), 1)
        with pytest.raises(BatchError, match="fewer than batch_size=64 rows"):
            t.fit(ray.data.from_items([{"x": X[i].numpy(), "y": Y[i].numpy()} for i in range(10)]), 1, batch_size=64)
        with pytest.raises(BatchError, match="ended after 2 batches"):
            t.fit(iter([batches(0), batches(1)]), 3)
        # a collate of your own maps any columns to (x, y)
        history = t.fit(
            renamed,
            t.step_count + 1,
            batch_size=8,
            collate=lambda b: (torch.from_numpy(b["features"]), torch.from_numpy(b["target"])),
        )
        assert history[0]["samples"] == 8 and np.isfinite(history[0]["loss"])
    with Trainer(MLP7, nn.functional.mse_loss, config(dp=1, engine="refs")) as t:
        with pytest.raises(ConfigError, match="engine='refs' is invalid with a ray.data.Dataset"):
            t.fit(dataset(), 1, batch_size=BATCH)
    assert os.getpid()  # the refused fits left the trainers usable until shutdown


def test_the_job_reads_the_same_batches_through_ray_data(ray_session):
    """The main job with `data.reader: ray_data` (its path on a cluster) trains on exactly the batches
    the driver would make: the same losses, step by step."""
    from pathlib import Path

    from raypipe.job import JobConfig, run

    tiny = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny.yaml"
    common = [
        "job.steps=6",
        "job.sample_tokens=0",
        "job.progress=false",
        "data.val_fraction=0",
        "dp=2",
        "cpus_per_actor=0.25",
        "threads_per_actor=1",
    ]
    lines = []
    driver = run(JobConfig.from_yaml(tiny, [*common, "data.reader=driver"]), log=lambda _: None)
    through = run(JobConfig.from_yaml(tiny, [*common, "data.reader=ray_data"]), log=lines.append)
    assert any("6 batches through Ray Data" in line for line in lines), lines
    assert through["losses"] == pytest.approx(driver["losses"], rel=1e-6, abs=1e-7)


def test_a_fit_fed_by_a_function_does_not_import_ray_data():
    """Asking whether fit's batches are a Dataset must not import Ray Data (0.7 s of the first fit
    in every process that never uses it); a Dataset exists only once ray.data is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from raypipe.driver.feeds import _is_dataset\n"
        "assert not _is_dataset(lambda step: None) and not _is_dataset([])\n"
        "assert 'ray.data' not in sys.modules, 'ray.data was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
