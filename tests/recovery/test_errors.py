"""Bad configs, bad batches, failing layers, unplaceable actors and stuck steps raise
clear errors quickly, and a trainer keeps working after a failed step."""

import time

import pytest
import ray
import torch
from torch import nn

from raypipe import (
    BatchError,
    ConfigError,
    LayerSpec,
    PlacementError,
    StageError,
    StepTimeoutError,
    TrainConfig,
    Trainer,
)

from helpers import MLP7, Exploding, Sleep, assert_close_dicts, batch, reference_run

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
QUARTER = 0.25  # CPUs per actor, so this module's trainers fit beside each other on 2 CPUs


@pytest.fixture(scope="module")
def trainer(ray_session):
    t = Trainer(
        MLP7, nn.functional.mse_loss, TrainConfig(pp=2, microbatches=4, optimizer=SGD, seed=3, cpus_per_actor=QUARTER)
    )
    yield t
    t.shutdown()


def test_batch_not_divisible_by_microbatches(trainer):
    x, y = batch(0, size=10)
    with pytest.raises(BatchError, match=r"10 samples cannot be split into microbatches=4.*e\.g\. 8"):
        trainer.step(x, y)


def test_targets_of_the_wrong_length(trainer):
    x, y = batch(0)
    with pytest.raises(BatchError, match=r"x has 16 samples but y has shape \(12, 3\)"):
        trainer.step(x, y[:12])
    with pytest.raises(BatchError, match="torch.Tensor"):
        trainer.step(x.numpy(), y)


def test_a_failed_step_names_stage_and_action_and_leaves_the_weights_alone(trainer):
    before = trainer.state_dict()
    x, y = batch(0)
    with pytest.raises(StageError, match=r"stage0-dp0-tp0 failed at 0F0: RuntimeError: .*shapes"):
        trainer.step(torch.randn(16, 5), y)  # 5 features where the first layer takes 6
    with pytest.raises(StageError, match=r"stage1-dp0-tp0 failed at 1F0: .*size"):
        trainer.step(x, torch.randn(16, 4))  # targets do not match the output shape
    after = trainer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the next good step is exactly a first step: no stale gradients or activations
    trainer.reset_optimizer()
    trainer.step(x, y)
    _, _, expected = reference_run(MLP7, 3, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=1)
    assert_close_dicts(trainer.state_dict(), expected)


def test_fields_that_shape_the_actors_cannot_be_reconfigured(trainer):
    with pytest.raises(ConfigError, match="pp cannot change on a running trainer"):
        trainer.reconfigure(pp=3)
    with pytest.raises(ConfigError, match="Did you mean 'microbatches'"):
        trainer.reconfigure(microbatch=2)


def test_loading_foreign_weights_names_the_keys(trainer):
    with pytest.raises(KeyError, match="name no layer"):
        trainer.load_state_dict({"9.weight": torch.zeros(1)})
    state = trainer.state_dict()
    del state["4.bias"]
    with pytest.raises(KeyError, match=r"nothing was loaded: layer 4: missing bias"):
        trainer.load_state_dict(state)


def test_bad_configs_fail_before_any_actor_starts(ray_session):
    groups = len(ray.util.placement_group_table())
    with pytest.raises(ConfigError, match="shard_plan"):
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, shard_plan=[[0, 3], [4, 7]]))
    with pytest.raises(ConfigError, match="only 7 layers"):
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=8))
    with pytest.raises(TypeError, match="built Linear"):
        Trainer([nn.Linear(2, 2)], nn.functional.mse_loss)
    assert len(ray.util.placement_group_table()) == groups  # nothing was reserved, so no actor was asked for


def test_a_layer_that_cannot_be_built_names_its_stage(ray_session):
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(Exploding)]
    with pytest.raises(
        StageError,
        match=r"stage1-dp0-tp0 \(layers \(1, 2\)\) could not start: layer 1 "
        r"LayerSpec\(Exploding\) failed to build: ValueError: this layer cannot be built$",
    ):
        Trainer(layers, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=QUARTER))


def test_unplaceable_actors_fail_within_the_start_timeout(ray_session, trainer):
    with pytest.raises(PlacementError) as info:  # raised at all: the timeout was kept
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=16, actor_start_timeout=2))
    message = str(info.value)
    assert "stage0-dp0-tp0" in message and "'CPU': 16.0" in message and "actor_start_timeout" in message
    assert f"Other trainers of this process still hold actors: {trainer!r}" in message
    deadline = time.monotonic() + 10
    while ray_session.available_resources().get("CPU") != 1.5 and time.monotonic() < deadline:
        time.sleep(0.1)  # the pending actors were killed; only the module's trainer holds CPUs
    assert ray_session.available_resources().get("CPU") == 1.5


@pytest.mark.parametrize(
    "actor_steps, pending",
    [(0, "stage1-dp0-tp0: 1F0, 1B0"), (3, "no report yet from stage0-dp0-tp0, stage1-dp0-tp0")],
    ids=["step", "actor-driven"],
)
def test_a_stuck_step_times_out_naming_what_is_pending(ray_session, actor_steps, pending):
    layers = [LayerSpec(nn.Linear, 4, 4), LayerSpec(Sleep, 30.0)]
    config = TrainConfig(pp=2, microbatches=2, step_timeout=1.0, cpus_per_actor=QUARTER, actor_steps=actor_steps)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with Trainer(layers, nn.functional.mse_loss, config) as t:
        with pytest.raises(StepTimeoutError) as info:  # unbounded, the 30 s sleep would end and nothing raise
            t.fit(lambda k: (x, y), 3) if actor_steps else t.step(x, y)
        assert t.group.actors == []  # the trainer stopped its actors
        with pytest.raises(Exception, match="no actors"):
            t.step(torch.randn(4, 4), torch.randn(4, 4))
    message = str(info.value)
    assert "no progress for 1 s" in message
    assert pending in message
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        alive = []
        for name in t.names:  # a named actor can be looked up until it is dead
            try:
                ray_session.get_actor(name, namespace=f"raypipe-{t.run_name}")
                alive.append(name)
            except ValueError:
                pass
        if not alive:
            break
        time.sleep(0.2)
    assert not alive, alive


def test_a_dropped_trainer_frees_its_actors(ray_session):
    import gc

    t = Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, cpus_per_actor=QUARTER))
    free = ray_session.available_resources().get("CPU")
    del t
    gc.collect()
    deadline = time.monotonic() + 10
    while ray_session.available_resources().get("CPU") != free + 2 * QUARTER and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray_session.available_resources().get("CPU") == free + 2 * QUARTER


def test_a_job_user_meets_each_error_with_its_file_field_value_and_fix(tmp_path):
    """Issue 60: errors that named nothing of the user's (a YAML traceback, numpy's missing file, a
    pp the user never wrote) now say where and what to do, before anything starts."""
    from raypipe import ConfigError
    from raypipe.checkpoint.layout import CheckpointError, find_valid
    from raypipe.job import JobConfig

    broken = tmp_path / "broken.yaml"
    broken.write_text("pp: 2\nmicrobatches: [4\nschedule: 1f1b\n")
    with pytest.raises(ConfigError, match=r"broken.yaml' is not valid YAML at line 3"):
        JobConfig.from_yaml(broken)
    job = tmp_path / "job.yaml"
    job.write_text("data: {source: bin, path: tokens/missing.bin}\n")
    with pytest.raises(ConfigError, match=r"data.path='tokens/missing.bin': no such file \(relative paths are from"):
        JobConfig.from_yaml(job)
    (tmp_path / "ck" / "step-00000002").mkdir(parents=True)
    (tmp_path / "ck" / "step-00000004").mkdir()
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 40 under .*: it holds steps \[2, 4\]"):
        find_valid(tmp_path / "ck", step=40)
    with pytest.raises(ConfigError, match=r"pp=4 is invalid with schedule='dualpipe-v': .* 8 in all, .* 7 layers"):
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=4, schedule="dualpipe-v", microbatches=8))


def test_a_kind_no_node_has_fails_fast_naming_the_fallback(ray_session):
    """Issue 60: `devices: cuda` on a CPU-only cluster with no autoscaler launching nodes fails in
    seconds, not after the whole actor_start_timeout (600 s here, past the test's own limit, so
    waiting it out fails the test), and says how to try it on the CPU."""
    with pytest.raises(PlacementError, match=r"no node can ever hold .*'cuda'.*allow_cpu_fallback=True"):
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=2, devices="cuda", actor_start_timeout=600))
