"""Checkpoints in object storage: a real S3-compatible server (moto's server mode) on 127.0.0.1,
every actor writing its own files straight to `s3://...`, the manifest written last as the commit
marker; exact resume from the bucket, a corrupt object and a save cut short by a killed actor."""

import pytest
import torch
from torch import nn

from raypipe import ConfigError, LayerSpec, TrainConfig, Trainer
from raypipe.checkpoint.layout import MANIFEST, find_valid, list_checkpoints, verify
from raypipe.checkpoint.storage import StoragePath

from helpers import MLP7, batch, flip_a_byte
from save_faults import KillOnSave, moto_s3

ADAMW = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
STEPS = 6


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server (`helpers.moto_s3`); yields a function giving the URI of a fresh prefix in
    its bucket (credentials and endpoint in the URI, which the actors open as they are)."""
    with open(tmp_path_factory.mktemp("moto") / "server.log", "w") as log, moto_s3("ckpt", log) as query:
        names = iter(range(1000))
        yield lambda: f"s3://key:secret@ckpt/run{next(names)}?{query}"


def config(root=None, **changes):
    base = dict(
        pp=2,
        microbatches=2,
        optimizer=ADAMW,
        seed=5,
        checkpoint_dir=root,
        checkpoint_every=2 if root else 0,
        keep_checkpoints=0,
    )
    base.update(changes)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def in_bucket(ray_session, s3):
    root = s3()
    with Trainer(MLP7, nn.functional.mse_loss, config(root)) as t:
        history = t.fit(batch, STEPS, log=lambda _: None)
    return [m["loss"] for m in history], root


def test_every_actor_writes_to_the_bucket_and_the_manifest_commits(in_bucket):
    _, root = in_bucket
    found = list_checkpoints(root)
    assert [p.name for p in found] == ["step-00000002", "step-00000004", "step-00000006"]
    meta = verify(found[1])  # every object's size and sha256, read back from the server
    assert meta["step"] == 4 and meta["pp"] == 2
    assert {p.name for p in (found[1] / "model").iterdir()} == {f"layer-{i:05d}.safetensors" for i in range(7)}
    assert "secret" not in str(found[1]) and "key:***@" in str(found[1])  # messages never show the secret


def test_resume_from_the_bucket_continues_exactly(in_bucket):
    losses, root = in_bucket
    with Trainer(MLP7, nn.functional.mse_loss, config(pp=1)) as t:
        where = t.load(root, step=2)
        assert where.name == "step-00000002" and t.step_count == 2
        resumed = [m["loss"] for m in t.fit(batch, STEPS)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-6, atol=1e-6)


def test_a_corrupt_object_and_a_step_without_manifest_fall_back_to_the_newest_valid(in_bucket):
    losses, root = in_bucket
    base = StoragePath(root)
    flip_a_byte(base / "step-00000006" / "model" / "layer-00004.safetensors")
    (base / "step-00000008" / "model" / "layer-00000.safetensors").write_bytes(b"a save cut short")
    warnings = []
    path, meta = find_valid(root, warn=warnings.append, contents=True)
    assert path.name == "step-00000004" and meta["step"] == 4
    assert "step-00000008: no MANIFEST.json" in warnings[0]
    assert "layer-00004.safetensors: sha256 does not match" in warnings[1]
    messages = []
    with Trainer(MLP7, nn.functional.mse_loss, config()) as t:  # the actors read the bytes, not the driver
        assert t.load(root, log=messages.append).name == "step-00000004"
        assert any("step-00000006" in m and "sha256 does not match" in m for m in messages), messages
        resumed = [m["loss"] for m in t.fit(batch, STEPS)]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[4:]), rtol=1e-6, atol=1e-6)


def test_an_actor_killed_mid_save_leaves_no_checkpoint_and_training_continues_exactly(ray_session, s3, tmp_path):
    """Stage 1's actor dies while the step-4 checkpoint is written (stage 0's objects may already be
    in the bucket): step 4 has no manifest, so recovery restores step 2, replays, and saves step 4
    again; the losses are the uninterrupted run's and pruning leaves the newest two."""
    flag = tmp_path / "kill-on-save"
    layers = MLP7[:4] + [LayerSpec(KillOnSave, str(flag))] + MLP7[4:]

    def run(root, arm):
        messages = []

        def on_step(metrics):
            if arm and metrics["step"] == 2 and not (tmp_path / "armed").exists():
                (tmp_path / "armed").touch()
                flag.touch()  # the next save (step 4) kills stage 1

        with Trainer(layers, nn.functional.mse_loss, config(root, max_restarts=1, keep_checkpoints=2)) as t:
            history = t.fit(batch, STEPS, on_step=on_step, log=messages.append)
        return {m["step"]: m["loss"] for m in history}, messages

    expected, _ = run(s3(), arm=False)
    root = s3()
    got, messages = run(root, arm=True)
    assert not flag.exists(), "the kill never happened"
    assert any("resumed at step 2 from" in m for m in messages), messages
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    kept = list_checkpoints(root)
    assert [p.name for p in kept] == ["step-00000004", "step-00000006"]
    assert all((p / MANIFEST).exists() for p in kept) and verify(kept[0])["step"] == 4


def test_keep_prunes_the_bucket_to_the_newest(ray_session, s3):
    root = s3()
    with Trainer(MLP7, nn.functional.mse_loss, config(root, checkpoint_every=1, keep_checkpoints=2)) as t:
        t.fit(batch, 4, log=lambda _: None)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000003", "step-00000004"]


def test_a_uri_that_cannot_be_opened_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot be opened"):
        StoragePath("nosuchscheme://bucket/run")


def test_a_secret_holding_slashes_opens_the_bucket_and_is_recorded_nowhere(ray_session, s3):
    """The URI's secret holds `/`, `+`, `=` and `@` (as AWS secrets do): the actors open the bucket with
    it, and neither trainer.json, the manifest nor the checkpoint's name shows it."""
    secret = "wJal/rXUt+nFEMI=K7@RfiCY"
    root = s3().replace("key:secret@", f"key:{secret}@")
    with Trainer(MLP7, nn.functional.mse_loss, config(root, checkpoint_every=1)) as t:
        saved = t.fit(batch, 1, log=lambda _: None)[-1]["checkpoint"]
    assert "wJal" not in saved and "key:***@ckpt/" in saved
    path = list_checkpoints(root)[0]
    for name in ("trainer.json", MANIFEST):
        text = (path / name).read_text()
        assert "wJal" not in text and "RfiCY" not in text, name
    assert verify(path)["step"] == 1


def test_a_step_saved_again_in_the_bucket_is_replaced_only_once_the_new_one_is_complete(ray_session, s3):
    """No rename in an object store: the new step-N is written whole beside the old one
    (`step-N.partial`), then swapped in, its manifest last. It holds the new state, not the old."""
    root = s3()
    with Trainer(MLP7, nn.functional.mse_loss, config(root)) as t:
        t.step(*batch(0))
        first = t.save()
        state = {k: v + 1 for k, v in t.state_dict().items()}
        t.load_state_dict(state)  # the same step, other weights
        assert t.save() == first
    assert [p.name for p in StoragePath(root).iterdir() if p.name.startswith("step-")] == ["step-00000001"]
    assert verify(first)["step"] == 1
    from raypipe.checkpoint.layout import load_tensors

    assert torch.equal(load_tensors(first / "model" / "layer-00000.safetensors")["weight"], state["0.weight"])


def test_a_bucket_root_is_held_by_a_lease_that_refuses_a_second_run_and_lapses_with_its_holder(s3, monkeypatch):
    import time

    from raypipe.checkpoint import lock
    from raypipe.checkpoint.layout import CheckpointError

    root = s3()
    held = lock.hold(root, "first")
    with pytest.raises(CheckpointError, match=r"in use by run first \(pid"):
        lock.RootLock(root, "second")._take_lease(StoragePath(root))  # another process's acquire: the lease says no
    held.release()
    assert not (StoragePath(root) / lock.LOCK).exists()
    monkeypatch.setattr(lock, "LEASE_S", 0.5)  # a holder that died: its lease lapses, nobody renews it
    lock.RootLock(root, "dead")._write_lease(StoragePath(root) / lock.LOCK)
    time.sleep(0.6)
    lock.hold(root, "third").release()
