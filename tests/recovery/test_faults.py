"""Nothing silently wrong under faults and misuse (issue 58): steps from several threads, calls
that reach the actors in different orders, a Ctrl-C while a step's calls go out, a recovery after
weights were loaded, a skipped step's buffers, two runs on one directory, links planted in a
checkpoint root, a same-step re-save cut short between its renames, a prune cut short, empty
batches, and stream headers that could run code. One pp = 2 trainer serves the in-memory cases."""

import _thread
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time

import pytest
import ray
import torch
from torch import nn

from raypipe import BatchError, LayerSpec, StageError, TrainConfig, Trainer
from raypipe.checkpoint import lock, tidy
from raypipe.checkpoint.layout import CheckpointError, find_valid, list_checkpoints, verify
from raypipe.core.protocol import StepCall

from helpers import MLP7, KillOnce, assert_close_dicts, batch, reference_run

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
QUIET = dict(log=lambda _: None)


def config(**changes):
    base = {"pp": 2, "microbatches": 2, "optimizer": SGD, "seed": 5, "cpus_per_actor": 0.25, "threads_per_actor": 1}
    return TrainConfig(**{**base, **changes})


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class Target:
    """A microbatch's target whose pickling on the driver, as its step's calls go out, sends this
    process a Ctrl-C (`interrupt`: one landing mid-send) or sleeps `pause` seconds (another
    thread then runs meanwhile)."""

    def __init__(self, value, interrupt=False, pause=0.0):
        self.value, self.interrupt, self.pause = value, interrupt, pause

    def __reduce__(self):
        time.sleep(self.pause)
        if self.interrupt:
            _thread.interrupt_main()  # what Python does on SIGINT, whichever thread the OS hands it to
        return (Target, (self.value,))


def target_loss(out, target):
    return nn.functional.mse_loss(out, getattr(target, "value", target))


def wrapped(k, **how):
    """Batch k as the step's microbatches, the last one's target a `Target`."""
    x, y = batch(k)
    return list(x.chunk(2)), [y[:8], Target(y[8:], **how)]


@pytest.fixture(scope="module")
def shared(ray_session):
    with Trainer(MLP7, target_loss, config(name="faults-shared", step_timeout=60)) as t:
        yield t


# ----- 1. steps from several threads, and calls that reach the actors in different orders --------


def test_steps_from_two_threads_take_turns_and_train_as_one_sequential_order(shared):
    t = shared
    t.load_state_dict(reference_run(MLP7, 5, sgd, steps=0)[2])  # the seed's weights, whatever ran before
    t.reset_optimizer()
    start, order, errors, together = t.step_count, {}, [], threading.Barrier(2, timeout=120)

    def worker(offset):
        try:
            for i in range(3):
                together.wait()  # both threads send a step at the same moment, every round
                # each thread's last call pauses as it goes out, the other thread running meanwhile
                order[t.step(*wrapped(offset + i, pause=0.05))["step"]] = offset + i
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and sorted(order) == list(range(start + 1, start + 7))
    ks = [order[s] for s in sorted(order)]  # the batches in the order their steps were applied
    _, _, expected = reference_run(MLP7, 5, sgd, steps=6, microbatches=2, data=lambda j: batch(ks[j]))
    assert_close_dicts(t.state_dict(), expected)


def test_calls_reaching_the_actors_in_different_orders_are_refused_and_change_nothing(shared):
    from raypipe.driver.engines.p2p import action_lists
    from raypipe.transport.wire import pack_microbatches

    t = shared
    g, before = t.group, t.state_dict()
    grid = g.topology.grid
    lists = action_lists(grid(g.actors), grid(g.names), grid(range(len(g.actors))), g.schedule)
    calls = []
    for call_id, (x, y) in ((10_001, batch(7)), (10_002, batch(8))):
        xs, ys = pack_microbatches(list(x.chunk(2))), pack_microbatches(list(y.chunk(2)))
        calls.append(
            [
                StepCall(
                    call_id=call_id,
                    step=t.step_count,
                    actions=lst.actions,
                    inputs=xs if lst.holds_first else None,
                    targets=ys,
                    peers=lst.peers,
                )
                for lst in lists
            ]
        )
    (first_a, last_a), (first_b, last_b) = calls
    stage0, stage1 = lists[0].actor, lists[1].actor
    # stage 0 runs call A then B, stage 1 call B then A: what two drivers on one trainer could do
    refs = [stage0.run_actions.remote(first_a), stage0.run_actions.remote(first_b)]
    refs += [stage1.run_actions.remote(last_b), stage1.run_actions.remote(last_a)]
    for ref in refs:
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=60)
        assert isinstance(info.value.cause, StageError) and "ran different step calls" in str(info.value.cause)
    assert_close_dicts(t.state_dict(), before, rtol=0, atol=0)
    assert t.step(*batch(9))["step"] == t.step_count  # the trainer goes on


def test_an_empty_batch_is_refused_as_a_batch_error_and_nothing_changes(shared):
    steps = shared.step_count
    for x, y in ((torch.zeros(0, 6), torch.zeros(0, 3)), ({"x": torch.zeros(0, 6)}, torch.zeros(0, 3))):
        with pytest.raises(BatchError, match="holds no samples"):
            shared.step(x, y)
    assert shared.step_count == steps


# ----- 2. a Ctrl-C while a step's calls go out --------------------------------------------------


def test_a_ctrl_c_while_a_step_goes_out_waits_until_every_actor_has_it_and_the_step_is_booked(ray_session):
    with Trainer(MLP7, target_loss, config(name="faults-sigint", step_timeout=600)) as t:
        with pytest.raises(KeyboardInterrupt):
            t.step(*wrapped(0, interrupt=True))
        assert t.step_count == 1  # every actor got the step and applied it: it counts
        # not stuck behind a half-sent step until step_timeout (600 s: past the test's own limit)
        assert t.step(*wrapped(1))["step"] == 2


# ----- 3. a recovery restores what the trainer held: loaded weights ------------------------------


def test_a_recovery_restores_weights_loaded_after_the_last_checkpoint(ray_session, tmp_path):
    flag = tmp_path / "kill"
    layers = MLP7[:4] + [LayerSpec(KillOnce, str(flag))] + MLP7[4:]
    loaded = {k: v + 0.5 for k, v in reference_run(layers, 5, sgd, steps=0)[2].items()}
    with Trainer(layers, nn.functional.mse_loss, config(name="faults-reload", max_restarts=1)) as t:
        t.load_state_dict(loaded)
        logs = []
        t.fit(batch, 2, log=logs.append)
        flag.touch()  # stage 1 dies in step 3: no checkpoint exists, the loaded weights do
        t.fit(batch, 4, log=logs.append)
        final = t.state_dict()
    assert any("the state dict loaded at step 0" in line for line in logs), logs
    _, _, expected = reference_run(layers, 5, sgd, steps=4, microbatches=2, prepare=lambda m: m.load_state_dict(loaded))
    assert_close_dicts(final, expected)


# ----- 4. a step that is not applied leaves every running statistic as it was ---------------------


def test_a_skipped_or_refused_non_finite_step_leaves_batchnorm_statistics_as_they_were(ray_session):
    layers = [LayerSpec(nn.Linear, 6, 8), LayerSpec(nn.BatchNorm1d, 8), LayerSpec(nn.Linear, 8, 3)]
    x, y = batch(0)
    with Trainer(layers, nn.functional.mse_loss, config(name="faults-bn", nonfinite="skip")) as t:
        t.step(x, y)
        before = t.state_dict()
        bad = x.clone()
        bad[3, 2] = float("nan")
        assert t.step(bad, y)["step"] == 2  # skipped: it counts, nothing of it stays
        assert_close_dicts(t.state_dict(), before, rtol=0, atol=0)
        t.reconfigure(nonfinite="error")
        with pytest.raises(Exception, match="non-finite"):
            t.step(bad, y)
        assert_close_dicts(t.state_dict(), before, rtol=0, atol=0)


# ----- 5. one live run per checkpoint root, and nothing deleted that a run did not write ----------


def test_a_second_live_run_is_refused_the_directory_until_the_first_ends(ray_session, tmp_path):
    root = tmp_path / "ck"
    first = Trainer(MLP7, nn.functional.mse_loss, config(name="faults-a", checkpoint_dir=str(root)))
    try:
        with pytest.raises(CheckpointError, match=r"in use by run faults-a \(pid \d+ on .*in this process"):
            Trainer(MLP7, nn.functional.mse_loss, config(name="faults-b", checkpoint_dir=str(root)))
        first.step(*batch(0))
        first.save()
    finally:
        first.shutdown()
    # once it ended, its run continues there (a new run is refused its checkpoints, as before)
    with Trainer(MLP7, nn.functional.mse_loss, config(name="faults-b", checkpoint_dir=str(root), resume=True)) as t:
        assert t.step_count == 1


def test_a_root_held_by_another_process_is_refused_and_freed_when_that_process_dies(tmp_path):
    code = (
        "import sys, time; from raypipe.checkpoint import lock; "
        f"lock.hold({str(tmp_path)!r}, 'holder'); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"in use by run holder \(pid {holder.pid} "):
            lock.hold(str(tmp_path), "me")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    mine = lock.hold(str(tmp_path), "me")  # the kernel released the dead holder's lock
    mine.release()
    assert not (tmp_path / lock.LOCK).exists()


def test_a_save_never_deletes_another_runs_partial_nor_follows_a_planted_link(ray_session, tmp_path):
    root, theirs = tmp_path / "ck", tmp_path / "attacker"
    theirs.mkdir()
    (theirs / "their-file").write_text("keep")
    with Trainer(MLP7, nn.functional.mse_loss, config(name="faults-links", checkpoint_dir=str(root))) as t:
        t.step(*batch(0))
        (root / "step-00000001.partial").symlink_to(theirs)
        with pytest.raises(CheckpointError, match=r"step-00000001.partial is a symbolic link"):
            t.save()
        (root / "step-00000001.partial").unlink()
        (root / "step-00000001.partial").mkdir()
        (root / "step-00000001.partial" / "RUN").write_text("another-run")
        with pytest.raises(CheckpointError, match="left by run another-run"):
            t.save()
        assert (root / "step-00000001.partial" / "RUN").read_text() == "another-run"
        shutil.rmtree(root / "step-00000001.partial")
        saved = t.save()
    assert sorted(p.name for p in theirs.iterdir()) == ["their-file"]
    # a planted link named like a checkpoint is never listed, loaded or pruned through
    (root / "step-00000009").symlink_to(saved)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000001"]
    assert find_valid(root)[0].name == "step-00000001"


# ----- 6. a checkpoint root recoverable at every instant -----------------------------------------


@pytest.fixture(scope="module")
def saved_run(ray_session, tmp_path_factory):
    """A run's checkpoint of step 2 (with `keep_checkpoints=1`), its directory and run id."""
    root = tmp_path_factory.mktemp("saved") / "ck"
    cfg = config(name="faults-saved", checkpoint_dir=str(root), checkpoint_every=2, keep_checkpoints=1)
    with Trainer(MLP7, nn.functional.mse_loss, cfg) as t:
        t.fit(batch, 2, **QUIET)
        return root, t.run_id


def test_a_same_step_resave_cut_short_between_its_renames_still_resumes(saved_run, tmp_path):
    source, run_id = saved_run
    root = tmp_path / "ck"
    shutil.copytree(source, root)
    # killed between `step-2 -> .step-2.replaced-*` and `step-2.partial -> step-2`: two complete copies
    shutil.copytree(root / "step-00000002", root / "step-00000002.partial")
    os.rename(root / "step-00000002", root / ".step-00000002.replaced-4242-abcd")
    assert verify(find_valid(root)[0])["step"] == 2
    os.rename(root / "step-00000002.partial", root / ".gone")  # and with the new copy lost too
    assert find_valid(root)[0].name == ".step-00000002.replaced-4242-abcd"
    cfg = config(name="faults-resumed", checkpoint_dir=str(root), resume=True, checkpoint_every=1, keep_checkpoints=1)
    with Trainer(MLP7, nn.functional.mse_loss, cfg) as t:
        assert t.step_count == 2 and t.run_id == run_id
        t.fit(batch, 3, **QUIET)
        t.save()  # the run's next saves put its step-N in place and sweep its debris
    assert sorted(p.name for p in root.iterdir() if p.name != ".gone") == ["step-00000003"]


def test_debris_of_cut_short_prunes_and_saves_is_swept_by_its_run_only(tmp_path):
    def made(name, run, manifest=False):
        (tmp_path / name).mkdir()
        if run:
            (tmp_path / name / "RUN").write_text(run)
        if manifest:
            (tmp_path / name / "MANIFEST.json").write_text("{}")

    made("step-00000004", "mine", manifest=True)
    made(".step-00000002.deleting-1-aa", "mine")  # a prune killed mid-delete
    made(".step-00000003.deleting-1-bb", "theirs")
    made(".step-00000004.replaced-1-cc", "mine", manifest=True)  # step 4 is in place: a stale old copy
    made(".step-00000005.replaced-1-dd", "mine", manifest=True)  # step 5 is not: the only copy, kept
    made("step-00000006.partial", "mine")  # a save cut short
    made("step-00000007.partial", "theirs")
    swept = tidy.clean_partials(tmp_path, "mine")
    assert sorted(swept) == [".step-00000002.deleting-1-aa", ".step-00000004.replaced-1-cc", "step-00000006.partial"]
    # a resume's abandoned future: complete checkpoints set aside, the run's own cut-short ones deleted
    made("step-00000008", "mine")
    assert tidy.set_aside(tmp_path, "mine", 4) == [".step-00000005.replaced-1-dd"]
    assert not (tmp_path / "step-00000008").exists()
    (aside,) = (tmp_path / "set-aside").iterdir()
    assert [p.name for p in aside.iterdir()] == ["step-00000005"]


# ----- 7. the wire's stream headers run no code --------------------------------------------------


class Planted:
    def __reduce__(self):
        return (os.system, ("touch /tmp/raypipe-header-ran",))


def test_stream_headers_are_json_and_a_pickled_header_is_refused_without_running(tmp_path):
    from raypipe.transport.stream import _FIELDS as AT  # where the layout starts, after the header's int64 fields
    from raypipe.transport.stream import HEADER_BYTES, header, read_header
    from raypipe.transport.tree import flatten

    value = {"h": torch.zeros(2, 3, dtype=torch.bfloat16), "mask": torch.ones(2, 3, dtype=torch.bool), "none": None}
    layout, _ = flatten(value)
    assert read_header(header(layout))[2] == layout
    encoded = bytes(header(layout)[AT:].numpy()).rstrip(b"\0")
    assert json.loads(encoded)["leaves"][0] == ["bfloat16", [2, 3]]
    planted = header(layout).clone()
    payload = pickle.dumps((Planted(), ()))
    planted[16:24].view(torch.int64).fill_(len(payload))  # the layout's length, the third field
    planted[AT : AT + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    assert len(planted) == HEADER_BYTES
    if os.path.exists("/tmp/raypipe-header-ran"):
        os.remove("/tmp/raypipe-header-ran")
    with pytest.raises(ValueError):
        read_header(planted)
    assert not os.path.exists("/tmp/raypipe-header-ran")
