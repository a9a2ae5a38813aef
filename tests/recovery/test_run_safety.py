"""A run's data is never lost or mixed up (issue 34): checkpoints belong to their run, secrets stay
out of every message and record, and failures (a full disk, a mismatched load, a broken logger, a
hung actor, SIGTERM, Ctrl-C) leave nothing half-done. One run's checkpoints ("run A") serve the
module."""

import json
import os
import shutil
import signal
import stat
import subprocess
import time

import pytest
import ray
import torch
from test_checkpoint import killable_layers, losses_by_step
from torch import nn

from raypipe import BatchError, ConfigError, LayerSpec, StepTimeoutError, TrainConfig, Trainer
from raypipe.checkpoint.layout import CheckpointError, find_valid, list_checkpoints, run_of, verify
from raypipe.checkpoint.storage import StoragePath, redact, split_uri

from helpers import MLP7, Sleep, batch
from save_faults import FailOnSave

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
QUIET = dict(log=lambda _: None)


def config(root=None, **changes):
    base = dict(
        pp=2,
        microbatches=2,
        optimizer=ADAMW,
        seed=5,
        checkpoint_dir=str(root) if root else None,
        checkpoint_every=2 if root else 0,
        keep_checkpoints=0,
    )
    base.update(changes)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def run_a(ray_session, tmp_path_factory):
    """Run A: 6 steps, a checkpoint every 2. Returns its losses, directory and run id."""
    root = tmp_path_factory.mktemp("run-a")
    with Trainer(MLP7, nn.functional.mse_loss, config(root)) as t:
        losses = [m["loss"] for m in t.fit(batch, 6, **QUIET)]
        return losses, root, t.run_id


# ----- 1. a checkpoint belongs to its run --------------------------------------------------


def test_a_new_run_refuses_a_used_directory_before_any_actor_starts(run_a):
    _, root, run_id = run_a
    name = "refused-run"
    with pytest.raises(CheckpointError) as info:
        Trainer(MLP7, nn.functional.mse_loss, config(root, name=name))
    message = str(info.value)
    assert run_id in message and "step 6" in message and "resume=True" in message and "of its own" in message
    assert not [g for g in ray.util.placement_group_table().values() if g["name"] == f"raypipe-{name}"]
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004", "step-00000006"]


def test_checkpoint_files_are_private_and_record_the_run(run_a):
    _, root, run_id = run_a
    path = root / "step-00000004"
    assert run_of(path) == run_id and verify(path)["run_id"] == run_id
    for file in [path, path / "model", path / "model" / "layer-00000.safetensors", path / "MANIFEST.json"]:
        mode = stat.S_IMODE(file.stat().st_mode)
        assert mode & 0o077 == 0, f"{file} is {oct(mode)}"


def test_resume_continues_the_run_and_sets_its_abandoned_future_aside(run_a, tmp_path):
    losses, original, run_id = run_a
    root = tmp_path / "ck"
    shutil.copytree(original, root)
    messages = []
    with Trainer(MLP7, nn.functional.mse_loss, config(root, pp=1, resume=2), log=messages.append) as t:
        assert t.step_count == 2 and t.run_id == run_id
        assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
        resumed = [m["loss"] for m in t.fit(batch, 6, **QUIET)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-6, atol=1e-6)
    shelved = list((root / "set-aside").iterdir())
    assert [p.name for p in sorted(shelved[0].iterdir())] == ["step-00000004", "step-00000006"]
    assert any("set aside" in m for m in messages), messages
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004", "step-00000006"]
    from raypipe.checkpoint.tidy import set_aside

    for _ in range(2):  # two resumes within one second (a notebook's load, step, load, fit): a shelf each
        for name in ("step-00000004", "step-00000006"):
            shutil.rmtree(root / name, ignore_errors=True)
            shutil.copytree(shelved[0] / name, root / name)
        assert set_aside(root, run_id, 2) == ["step-00000004", "step-00000006"]
    assert len(list((root / "set-aside").iterdir())) == 3


def test_pruning_and_recovery_keep_to_their_own_run(run_a, tmp_path):
    """The issue's run B: another run's newer checkpoint lies in B's directory (copied in after B
    started). B's keep=2 prunes only B's, and B's recovery restores B's own step 3, not the other
    run's step 6: B's losses are those of B uninterrupted."""
    _, original, run_a_id = run_a
    flag, root = tmp_path / "kill-now", tmp_path / "b"
    cfg = config(root, seed=2, checkpoint_every=1, keep_checkpoints=2, max_restarts=1)
    with Trainer(killable_layers(tmp_path / "never"), nn.functional.mse_loss, config(seed=2)) as t:
        expected = [m["loss"] for m in t.fit(batch, 5, **QUIET)]
    messages = []
    with Trainer(killable_layers(flag), nn.functional.mse_loss, cfg) as t:
        shutil.copytree(original / "step-00000006", root / "step-00000006")

        def on_step(metrics):
            if metrics["step"] == 3 and t.restarts == 0:
                flag.touch()  # stage 1 kills its own process in step 4

        history = t.fit(batch, 5, on_step=on_step, log=messages.append)
        assert t.restarts == 1 and t.step_count == 5
    assert any("resumed at step 3 from" in m for m in messages), messages
    torch.testing.assert_close(torch.tensor(losses_by_step(history)), torch.tensor(expected), rtol=1e-6, atol=1e-6)
    kept = {p.name: run_of(p) for p in list_checkpoints(root)}
    assert kept == {"step-00000004": t.run_id, "step-00000005": t.run_id, "step-00000006": run_a_id}


# ----- 2. secrets never leave the URI ----------------------------------------------------------

SECRET = "wJal/rXUt+nFEMI=K7M?DENG#bPx@RfiCY"


def test_a_secret_with_every_awkward_character_is_parsed_and_never_shown():
    uri = f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs/a?endpoint_override=127.0.0.1:9&session_token=tok"
    parts = split_uri(uri)
    assert (parts.user, parts.secret, parts.rest) == ("AKIAEXAMPLE", SECRET, "bucket/runs/a")
    assert redact(uri) == "s3://AKIAEXAMPLE:***@bucket/runs/a?endpoint_override=127.0.0.1:9&session_token=***"
    cfg = TrainConfig(checkpoint_dir=uri, loggers=[{"mlflow": {"tracking_uri": f"http://me:{SECRET}@host/x"}}])
    from raypipe.observe.loggers import run_params

    for shown in (str(cfg), json.dumps(cfg.to_dict()), json.dumps(run_params(cfg, "r", [[0, 7]]))):
        assert "wJal" not in shown and "RfiCY" not in shown and "***" in shown
    with pytest.raises(ConfigError) as info:  # pyarrow's "Cannot parse URI" quotes it, secret %-escaped: scrubbed
        StoragePath(f"s3://AKIAEXAMPLE:{SECRET}@bucket:notaport/run")
    message = str(info.value)
    assert "Cannot parse URI" in message and "AKIAEXAMPLE:***@bucket" in message
    assert "wJal" not in message and "RfiCY" not in message, message
    unreachable = f"s3://AKIAEXAMPLE:{SECRET}@bucket/run?endpoint_override=127.0.0.1:1&scheme=http&region=us-east-1"
    with pytest.raises(CheckpointError, match="cannot be listed") as info:  # the unreachable bucket
        Trainer(MLP7, nn.functional.mse_loss, TrainConfig(checkpoint_dir=unreachable))
    assert "wJal" not in str(info.value) and "AKIAEXAMPLE:***@bucket" in str(info.value)
    with pytest.raises(ConfigError) as info:
        TrainConfig(checkpoint_dir=f"s3://AKIAEXAMPLE:{SECRET}@")
    assert "wJal" not in str(info.value) and "names no bucket" in str(info.value)


# ----- 3. failures leave nothing half-done ---------------------------------------------------


def test_loads_are_all_or_nothing(run_a):
    _, root, _ = run_a
    wider = [
        LayerSpec(nn.Linear, 6, 16),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 16, 16),
        LayerSpec(nn.GELU),
        LayerSpec(nn.Linear, 16, 10),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, 10, 3),
    ]  # same depth, stage 1 differs
    with Trainer(wider, nn.functional.mse_loss, config()) as t:
        before = t.state_dict()
        with pytest.raises(CheckpointError, match=r"nothing was loaded.*layer 4: weight has shape \[12, 16\]"):
            t.load(str(root))
        state = dict(before)
        state["6.weight"] = torch.zeros(3, 12)  # stage 1's tensor of the wrong shape; stage 0's all fit
        del state["0.bias"]
        with pytest.raises(KeyError, match=r"nothing was loaded.*layer 0: missing bias.*layer 6: weight has shape"):
            t.load_state_dict(state)
        after = t.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert t.step_count == 0 and t.step(*batch(0))["step"] == 1  # still usable


def test_bad_token_ids_are_refused_on_the_driver_and_nothing_changes(ray_session):
    embed = [LayerSpec(nn.Embedding, 10, 6), LayerSpec(nn.Linear, 6, 3)]  # token ids 0..9 -> (B, T, 3)
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    y = torch.randn(4, 5, 3)
    with Trainer(embed, nn.functional.mse_loss, config()) as t:
        before = t.state_dict()
        bad = ids.clone()
        bad[3, 1] = 10
        with pytest.raises(BatchError, match=r"x\[3, 1\] = 10 is not a token id of the model's vocabulary of 10"):
            t.step(bad, y)
        with pytest.raises(BatchError, match=r"x\['input_ids'\]\[0, 0\] = -1"):
            t.step({"input_ids": torch.full((4, 5), -1)}, y)
        with pytest.raises(BatchError, match=r"x is a torch.float32 tensor.*give integer ids"):
            t.step(ids.float(), y)
        assert t.step_count == 0 and all(torch.equal(before[k], v) for k, v in t.state_dict().items())
        assert t.step(ids, y)["step"] == 1


def test_a_checkpoint_of_another_optimizer_loads_its_weights_and_starts_the_optimizer_afresh(run_a):
    _, root, _ = run_a
    messages = []
    with Trainer(MLP7, nn.functional.mse_loss, config(optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9})) as t:
        t.load(str(root), step=4, log=messages.append)
        assert t.step(*batch(4))["step"] == 5
    assert any("holds adamw optimizer state; this run uses sgd" in m for m in messages), messages


@pytest.mark.parametrize(
    "manifest",
    [
        [],
        {"format": 1},
        {"format": 1, "files": []},
        {"format": 1, "files": {"trainer.json": 3}},
        {"format": 1, "files": {"trainer.json": {"bytes": "many", "sha256": None}}},
        {"format": 1, "files": {}},
    ],
    ids=["list", "no-files", "files-list", "entry-int", "entry-types", "no-trainer-json"],
)
def test_corrupt_manifests_of_any_shape_fall_back_to_the_previous_checkpoint(run_a, tmp_path, manifest):
    _, original, _ = run_a
    root = tmp_path / "copy"
    for name in ("step-00000002", "step-00000004"):
        shutil.copytree(original / name, root / name)
    (root / "step-00000004" / "MANIFEST.json").write_text(json.dumps(manifest))
    warnings = []
    path, meta = find_valid(root, warn=warnings.append)
    assert path.name == "step-00000002" and meta["step"] == 2
    assert "step-00000004" in warnings[0]


def test_a_trainer_json_without_its_fields_is_skipped(run_a, tmp_path):
    _, original, _ = run_a
    root = tmp_path / "copy"
    for name in ("step-00000002", "step-00000004"):
        shutil.copytree(original / name, root / name)
    from raypipe.checkpoint.layout import write_atomic

    path = root / "step-00000004"
    manifest = json.loads((path / "MANIFEST.json").read_text())
    manifest["files"]["trainer.json"] = write_atomic(path / "trainer.json", b'{"step": 4}')
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    warnings = []
    assert find_valid(root, warn=warnings.append)[0].name == "step-00000002"
    assert "trainer.json: lacks" in warnings[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 160 KiB tmpfs (one checkpoint of MLP7 fits, two do not), unmounted at the end."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def test_a_full_disk_mid_save_leaves_no_debris_and_keeps_the_last_checkpoint(ray_session, small_disk):
    root = small_disk / "ck"
    with Trainer(MLP7, nn.functional.mse_loss, config(root, keep_checkpoints=1)) as t:
        t.fit(batch, 2, **QUIET)
        with pytest.raises(
            CheckpointError, match="(?s)step 4's checkpoint could not be written.*No space left.*free the space"
        ):
            t.fit(batch, 4, **QUIET)
        assert t.step_count == 4  # the step ran; only its checkpoint is missing
        assert t.loggers.status == "FAILED"  # what the loggers will record: never FINISHED
        # no .partial, no temporary file: only the trainer's hold on the directory (`checkpoint.lock`)
        assert sorted(p.name for p in root.iterdir()) == [".raypipe-lock", "step-00000002"]
        assert verify(root / "step-00000002")["step"] == 2
        shutil.rmtree(root / "step-00000002")  # space freed: the same trainer saves step 4
        assert t.save().name == "step-00000004" and verify(root / "step-00000004")["step"] == 4


def test_a_failed_save_inside_fit_is_retried_within_max_restarts(ray_session, tmp_path):
    flag, root = tmp_path / "fail-once", tmp_path / "ck"
    layers = MLP7[:4] + [LayerSpec(FailOnSave, str(flag))] + MLP7[4:]
    messages = []
    with Trainer(layers, nn.functional.mse_loss, config(root, max_restarts=1)) as t:

        def on_step(metrics):
            if metrics["step"] == 3:
                flag.touch()  # step 4's save fails once, in stage 1, after stage 0 wrote its files

        history = t.fit(batch, 4, on_step=on_step, log=messages.append)
        assert t.restarts == 1 and [m["step"] for m in history] == [1, 2, 3, 4]
    assert history[-1]["checkpoint"].endswith("step-00000004")
    assert any("retrying the save (restart 1 of 1)" in m and "simulated storage error" in m for m in messages)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000004"]
    assert verify(root / "step-00000004")["step"] == 4


def test_a_broken_logger_never_costs_a_checkpoint(ray_session, tmp_path, capfd):
    (tmp_path / "a-file").write_text("")
    unreachable = f"sqlite:///{tmp_path}/a-file/runs.db"  # a store that cannot be made: its parent is a file
    cfg = config(tmp_path / "ck", loggers=[{"mlflow": {"tracking_uri": unreachable}}])
    with Trainer(MLP7, nn.functional.mse_loss, cfg) as t:
        t.fit(batch, 2, **QUIET)
    assert [p.name for p in list_checkpoints(tmp_path / "ck")] == ["step-00000002"]
    assert "logger mlflow.open failed" in capfd.readouterr().err


def test_every_driver_wait_is_bounded(ray_session):
    from raypipe.driver.results import gather

    @ray.remote(num_cpus=0)
    class Stuck:
        def hang(self):
            time.sleep(60)

    stuck = Stuck.remote()  # an unbounded wait would return its answer after 60 s, raising nothing
    with pytest.raises(StepTimeoutError, match=r"save did not finish within 1 s.*still waiting on stage9"):
        gather([stuck.hang.remote()], "save", [stuck], ["stage9"], timeout=1)
    ray.kill(stuck)


def test_sigterm_saves_the_last_step_marks_the_run_killed_and_releases_everything(ray_session, tmp_path):
    import mlflow

    store = f"sqlite:///{tmp_path}/runs.db"
    cfg = config(tmp_path / "ck", name="terminated", loggers=[{"mlflow": {"tracking_uri": store}}])
    t = Trainer(MLP7, nn.functional.mse_loss, cfg)

    def on_step(metrics):
        if metrics["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `ray job stop` or a preempted node would

    before = signal.getsignal(signal.SIGTERM)  # Ray's own
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        t.fit(batch, 6, on_step=on_step, **QUIET)
    assert signal.getsignal(signal.SIGTERM) is before  # fit's handler is gone again
    assert t.step_count == 3 and verify(tmp_path / "ck" / "step-00000003")["step"] == 3
    assert not t.group.actors  # shut down: actors stopped, placement group removed
    groups = [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == "raypipe-terminated"]
    assert groups == ["REMOVED"], groups
    runs = mlflow.MlflowClient(store).search_runs(
        [mlflow.MlflowClient(store).get_experiment_by_name("raypipe").experiment_id]
    )
    assert [r.info.status for r in runs] == ["KILLED"]


def test_ctrl_c_saves_the_last_step_and_keeps_the_trainer_usable(ray_session, tmp_path):
    """Also: the run's first save clears the `.partial` debris a killed driver of the run left (and
    one killed before it named its run), never another run's."""
    root = tmp_path / "ck"
    (root / "step-00000009.partial" / "model").mkdir(parents=True)  # killed before it wrote RUN
    (root / "step-00000001.partial").mkdir()
    (root / "step-00000001.partial" / "RUN").write_text("another-run")
    with Trainer(MLP7, nn.functional.mse_loss, config(root, checkpoint_every=4)) as t:

        def on_step(metrics):
            if metrics["step"] == 3:
                raise KeyboardInterrupt  # a notebook's stop button, a terminal's Ctrl-C

        with pytest.raises(KeyboardInterrupt):
            t.fit(batch, 6, on_step=on_step, **QUIET)
        assert t.step_count == 3 and verify(root / "step-00000003")["step"] == 3
        assert sorted(p.name for p in root.iterdir()) == [".raypipe-lock", "step-00000001.partial", "step-00000003"]
        assert t.loggers.status == "KILLED"
        assert t.fit(batch, 4, **QUIET)[-1]["step"] == 4  # the notebook goes on from here


def test_a_logger_that_hangs_at_shutdown_is_given_up_after_the_call_timeout(monkeypatch, capfd):
    from raypipe.observe.loggers import Loggers

    class Hanging:
        def close(self, status):
            time.sleep(60)

    monkeypatch.setenv("RAYPIPE_CALL_TIMEOUT", "1")
    loggers = Loggers(TrainConfig(loggers=[]), "r", dict)
    loggers.open, loggers.opened = [Hanging()], True
    loggers.close()  # a close waited for to the end would return after 60 s with no TimeoutError
    assert "Hanging.close failed (TimeoutError: no answer within 1 s" in capfd.readouterr().err


def test_ctrl_c_while_waiting_for_resources_leaves_no_reservation(ray_session):
    import _thread
    import threading

    cfg = TrainConfig(pp=2, cpus_per_actor=2.0, actor_start_timeout=600, name="never-placed")  # 4 CPUs of 2
    threading.Timer(1.0, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):  # an interrupt left unheard would wait past the test's limit
        Trainer(MLP7, nn.functional.mse_loss, cfg)
    groups = [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == "raypipe-never-placed"]
    assert groups == ["REMOVED"], groups


def test_an_interrupted_step_is_booked_so_the_step_count_matches_the_weights(ray_session):
    import _thread
    import threading

    slow = MLP7[:3] + [LayerSpec(Sleep, 0.4)] + MLP7[3:]
    with Trainer(slow, nn.functional.mse_loss, config()) as t:
        before = t.state_dict()
        threading.Timer(0.3, _thread.interrupt_main).start()  # while the driver waits for the step
        with pytest.raises(KeyboardInterrupt):
            t.step(*batch(0))
        assert t.step_count == 1  # the actors finished the step and applied it: it counts
        assert any(not torch.equal(before[k], v) for k, v in t.state_dict().items())
        assert t.step(*batch(1))["step"] == 2
