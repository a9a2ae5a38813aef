"""Checkpoints, resume on any topology, exact continuation, corruption, actor failures, NaN."""

import json
import os
import re
import shutil
import threading
import time

import pytest
import ray
import torch
from torch import nn

from raypipe import ActorDiedError, NonFiniteError, TrainConfig, Trainer
from raypipe.checkpoint.layout import CheckpointError, find_valid, list_checkpoints, load_tensors, verify

from helpers import MLP7, KillOnce, batch, flip_a_byte

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
STEPS = 6


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


def losses_by_step(history):
    """The loss of each step, the last run of it winning (replayed steps run twice)."""
    return [loss for _, loss in sorted({m["step"]: m["loss"] for m in history}.items())]


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    with Trainer(MLP7, nn.functional.mse_loss, config(root)) as t:
        history = t.fit(batch, STEPS, log=lambda _: None)
    return [m["loss"] for m in history], root


def test_checkpoints_are_complete_verified_and_keyed_by_layer(uninterrupted):
    _, root = uninterrupted
    names = [p.name for p in root.iterdir()]
    assert sorted(names) == ["step-00000002", "step-00000004", "step-00000006"]  # no .partial left
    path = root / "step-00000004"
    meta = verify(path)
    assert meta["step"] == 4 and meta["data_position"] == 4 and meta["pp"] == 2
    manifest = json.loads((path / "MANIFEST.json").read_text())
    expected = {f"{kind}/layer-{i:05d}.safetensors" for kind in ("model", "optim") for i in range(7)}
    assert expected | {"rng/stage-0.safetensors", "rng/stage-1.safetensors", "trainer.json"} == set(manifest["files"])
    assert set(load_tensors(path / "model/layer-00002.safetensors")) == {"weight", "bias"}
    assert set(load_tensors(path / "optim/layer-00002.safetensors")["weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    from safetensors import safe_open  # plain safetensors files: any safetensors reader opens them

    with safe_open(str(path / "optim/layer-00002.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {f"{p}/{k}" for p in ("weight", "bias") for k in ("step", "exp_avg", "exp_avg_sq")}


def test_keep_prunes_to_the_newest(ray_session, tmp_path):
    with Trainer(MLP7, nn.functional.mse_loss, config(tmp_path, checkpoint_every=1, keep_checkpoints=2)) as t:
        t.fit(batch, 4, log=lambda _: None)
        assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
        assert t.save(str(tmp_path / "manual")).name == "step-00000004"


@pytest.mark.parametrize("pp, dp", [(2, 1), (1, 1), (2, 2)], ids=["pp2", "pp1", "pp2-dp2"])
def test_resume_continues_exactly_on_any_topology(uninterrupted, pp, dp):
    losses, root = uninterrupted
    with Trainer(MLP7, nn.functional.mse_loss, config(pp=pp, dp=dp, microbatches=2 // dp)) as t:
        where = t.load(str(root), step=2)
        assert where.name == "step-00000002" and t.step_count == 2
        resumed = [m["loss"] for m in t.fit(batch, STEPS)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-6, atol=1e-6)


def test_corrupt_checkpoints_fall_back_to_the_previous_valid_one(uninterrupted, tmp_path):
    _, original = uninterrupted
    root = tmp_path / "copy"
    shutil.copytree(original, root)
    flip_a_byte(root / "step-00000006" / "model" / "layer-00004.safetensors")
    (root / "step-00000004" / "optim" / "layer-00000.safetensors").write_bytes(b"trunc")
    warnings = []
    assert find_valid(root, warn=warnings.append)[0].name == "step-00000006" and not warnings  # sizes, not bytes
    path, meta = find_valid(root, warn=warnings.append, contents=True)
    assert path.name == "step-00000002" and meta["step"] == 2
    assert "layer-00004.safetensors: sha256 does not match" in warnings[0]
    assert "layer-00000.safetensors" in warnings[1] and "truncated" in warnings[1]
    (root / "step-00000002" / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        find_valid(root, warn=warnings.append, contents=True)
    assert "no MANIFEST.json" in warnings[-1]
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        find_valid(root, step=6, contents=True)


def test_trainer_load_reports_and_skips_a_corrupt_newest(uninterrupted, tmp_path, monkeypatch):
    """The driver reads manifests and sizes only; the actors find a flipped byte in the files they
    read, before anything is loaded, and the trainer takes the next newest checkpoint."""
    from raypipe.checkpoint import layout

    hashed = []  # what the driver process reads whole
    real = layout.sha256_file
    monkeypatch.setattr(layout, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    losses, original = uninterrupted
    root = tmp_path / "copy"
    shutil.copytree(original, root)
    flip_a_byte(root / "step-00000006" / "model" / "layer-00004.safetensors")
    messages = []
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        before = t.state_dict()
        with pytest.raises(
            CheckpointError, match=r"layer-00004.safetensors: sha256 does not match.*nothing was loaded"
        ):
            t.load(str(root), step=6)
        assert all(torch.equal(v, t.state_dict()[k]) for k, v in before.items())
        assert t.load(str(root), log=messages.append).name == "step-00000004"
        resumed = [m["loss"] for m in t.fit(batch, STEPS)]
    assert hashed and set(hashed) == {"trainer.json"}, hashed
    assert any(
        "skipping invalid checkpoint" in m and "step-00000006" in m and "sha256 does not match" in m for m in messages
    )
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[4:]), rtol=1e-6, atol=1e-6)


KILLABLE = MLP7[:4] + [None] + MLP7[4:]  # the KillOnce layer goes into stage 1


def killable_layers(flag):
    from raypipe import LayerSpec

    return [LayerSpec(KillOnce, str(flag)) if spec is None else spec for spec in KILLABLE]


@pytest.fixture(scope="module")
def killable_baseline(ray_session, tmp_path_factory):
    """Uninterrupted losses per dp (the replicas' all-reduce changes float rounding slightly)."""
    flag = tmp_path_factory.mktemp("flag") / "never"
    baselines = {}

    def get(dp):
        if dp not in baselines:
            with Trainer(killable_layers(flag), nn.functional.mse_loss, config(dp=dp)) as t:
                baselines[dp] = [m["loss"] for m in t.fit(batch, STEPS)]
        return baselines[dp]

    return get


def kill_when_exists(actor, path, timeout=30.0):
    """ray.kill(actor) as soon as `path` exists (the actor made it, inside a step)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    ray.kill(actor)


# both ways of dying at pp=2 (one under the compiled engine); the dp=2 restart (a collective world to rebuild,
# from the surviving replica's memory) once
# "corrupt": the newest checkpoint (step 4) rots before stage 1 dies in step 6; the actors find it
# when they hash what they load, and the recovery takes step 2 instead. "actors": the steps in runs of
# 3 that the actors drive, their batches from the trainer's reader, which the restart gives the new actors
@pytest.mark.parametrize(
    "how, dp, engine",
    [
        ("ray.kill", 1, "p2p"),
        ("SIGKILL", 1, "compiled"),
        ("ray.kill", 2, "p2p"),
        ("corrupt", 1, "p2p"),
        ("SIGKILL", 1, "actors"),
    ],
    ids=["ray.kill-pp2", "SIGKILL-pp2-compiled", "ray.kill-pp2-dp2", "corrupt-newest-pp2", "SIGKILL-pp2-actors"],
)
def test_training_survives_a_stage_dying_mid_step(killable_baseline, tmp_path, how, dp, engine):
    flag = tmp_path / "kill-now"
    messages = []
    driven = engine == "actors"
    engine, actor_steps = ("p2p", 3) if driven else (engine, 0)
    cfg = config(tmp_path / "ck", max_restarts=2, dp=dp, engine=engine, actor_steps=actor_steps)
    with Trainer(killable_layers(flag), nn.functional.mse_loss, cfg) as t:
        victim = t.group.actors[-1]  # stage 1 of the last replica

        def on_step(metrics):
            if how == "corrupt" and metrics["step"] == 5 and t.restarts == 0:
                flip_a_byte(tmp_path / "ck" / "step-00000004" / "model" / "layer-00005.safetensors")
                flag.touch()
            elif how != "corrupt" and metrics["step"] == (1 if driven else 3) and t.restarts == 0:
                if how == "SIGKILL":
                    flag.touch()  # stage 1 kills its own process in step 4's first forward
                else:  # stage 1 pauses in step 4's first forward, and is killed from outside there
                    flag.write_text("pause")
                    threading.Thread(target=kill_when_exists, args=(victim, f"{flag}.paused"), daemon=True).start()

        history = t.fit(batch, STEPS, on_step=on_step, log=messages.append)
        assert t.restarts == 1
        # the recovery reserved a fresh placement group and removed the old one
        groups = [g["state"] for g in ray.util.placement_group_table().values() if g["name"] == f"raypipe-{t.run_name}"]
        assert sorted(groups) == ["CREATED", "REMOVED"], groups
    died = 6 if how == "corrupt" else 4
    # the actors driving the steps ran ahead of the one the flag was set at: it died in a later one
    dying = r"stage1-dp0-tp0 died" if driven else rf"stage1-dp\d-tp0 died during step {died}"
    assert any(re.search(dying, m) for m in messages), messages
    if driven:
        assert any(re.search(r"resumed at step [24] from", m) for m in messages), messages
    elif dp == 1:
        assert any("resumed at step 2 from" in m for m in messages), messages
    else:  # the surviving replica hands its state over (issue 38): step 4 runs again, nothing is replayed
        assert any("resumed at step 3 from the surviving replicas" in m for m in messages), messages
        assert [m["step"] for m in history] == list(range(1, STEPS + 1)), messages
    if how == "corrupt":
        assert any("skipping invalid checkpoint" in m and "layer-00005.safetensors: sha256" in m for m in messages)
    torch.testing.assert_close(
        torch.tensor(losses_by_step(history)), torch.tensor(killable_baseline(dp)), rtol=1e-6, atol=1e-6
    )
    for path in list_checkpoints(tmp_path / "ck"):
        verify(path)
    assert not list((tmp_path / "ck").glob("*.partial"))


def test_too_many_deaths_stop_with_who_why_and_where(ray_session, tmp_path):
    flag = tmp_path / "kill-now"
    with Trainer(killable_layers(flag), nn.functional.mse_loss, config(tmp_path / "ck")) as t:

        def on_step(metrics):
            if metrics["step"] == 2:
                flag.touch()

        with pytest.raises(ActorDiedError) as info:  # noticed as a death, not as a StepTimeoutError
            t.fit(batch, STEPS, on_step=on_step, log=lambda _: None)
    message = str(info.value)
    assert info.value.actor == "stage1-dp0-tp0"
    assert "stage1-dp0-tp0 died during step 3" in message
    assert "SIGKILL" in message or "killed" in message or "exit" in message.lower(), message
    assert "max_restarts=0" in message and "step-00000002" in message


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_nonfinite_loss_policies(ray_session, policy):
    def poisoned(k):
        x, y = batch(k)
        if k == 2:
            x[3, 1] = float("nan")
        return x, y

    with Trainer(MLP7, nn.functional.mse_loss, config(nonfinite=policy)) as t:
        t.fit(poisoned, 2)
        before = t.state_dict()
        if policy == "error":
            with pytest.raises(NonFiniteError, match="step 3: non-finite loss"):
                t.step(*poisoned(2))
            assert t.step_count == 2
        else:
            metrics = t.step(*poisoned(2))
            assert metrics["skipped"] and t.step_count == 3
        after = t.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # the weights were kept
        metrics = t.step(*batch(3))
        assert not metrics["skipped"] and torch.isfinite(torch.tensor(metrics["loss"]))


def test_an_actor_that_cannot_see_the_directory_says_so(ray_session, tmp_path):
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        with pytest.raises(Exception, match="cannot see the checkpoint directory .*shares"):
            ray.get(t.group.actors[0].save_checkpoint.remote(str(tmp_path / "not-there")))


def test_a_checkpoint_saved_under_zero1_resumes_without_it(ray_session, tmp_path):
    with Trainer(MLP7, nn.functional.mse_loss, config(tmp_path, dp=2, zero=1, microbatches=1)) as t:
        sharded = [m["loss"] for m in t.fit(batch, 4)]
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        t.load(str(tmp_path), step=2)
        resumed = [m["loss"] for m in t.fit(batch, 4)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(sharded[2:]), rtol=1e-6, atol=1e-6)


def test_loading_unpickles_nothing_and_pickle_checkpoints_still_load(uninterrupted, tmp_path, monkeypatch):
    """A checkpoint's tensors load without torch.load (so without unpickling); one written before
    safetensors (`.pt` files from torch.save) resumes exactly as well, through weights_only."""
    import hashlib

    losses, original = uninterrupted
    path = original / "step-00000002"
    state = load_tensors(path / "optim/layer-00002.safetensors")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    assert torch.equal(
        load_tensors(path / "optim/layer-00002.safetensors")["weight"]["exp_avg"], state["weight"]["exp_avg"]
    )
    monkeypatch.undo()
    legacy = tmp_path / "legacy" / "step-00000002"  # the same checkpoint as the old format wrote it
    shutil.copytree(path, legacy)
    manifest = json.loads((legacy / "MANIFEST.json").read_text())
    files = {}
    for name, entry in manifest["files"].items():
        if name.endswith(".safetensors"):
            old = legacy / name
            torch.save(load_tensors(old), old.with_suffix(".pt"))
            old.unlink()
            name = name.removesuffix(".safetensors") + ".pt"
            data = (legacy / name).read_bytes()
            entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        files[name] = entry
    (legacy / "MANIFEST.json").write_text(json.dumps({**manifest, "files": files}))
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:
        t.load(str(legacy))
        resumed = [m["loss"] for m in t.fit(batch, STEPS, log=lambda _: None)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-6, atol=1e-6)
