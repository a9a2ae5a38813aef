"""Experiment loggers: one pipeline run logs to TensorBoard, MLflow (a sqlite store) and W&B (offline)
at once, and each library's own reader gives back the step metrics and the run's configuration."""

import glob
import json
import struct
import time

import pytest
from torch import nn

from raypipe import ConfigError, TrainConfig, Trainer
from raypipe.config import loggers as logger_table
from raypipe.observe import loggers as loggers_module

from helpers import MLP7, batch, tensorboard_run

STEPS = 3


@pytest.fixture(scope="module")
def logged(ray_session, tmp_path_factory):
    """A pp=2 run of 3 steps with all three loggers, and a validation loss logged after it."""
    root = tmp_path_factory.mktemp("loggers")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    config = TrainConfig(
        pp=2,
        microbatches=2,
        name="loggers-test",
        log_dir=str(root / "tb"),
        cpus_per_actor=0.5,
        optimizer={"name": "sgd", "lr": 0.05},
        loggers=[
            "tensorboard",
            {"mlflow": {"tracking_uri": uri, "experiment": "raypipe-tests"}},
            {"wandb": {"mode": "offline", "dir": str(root), "project": "raypipe-tests"}},
        ],
    )
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        history = t.fit(batch, STEPS)
        t.log({"val/loss": 0.25})
    return {"root": root, "uri": uri, "history": history, "plan": t.plan}


def test_mlflow_run_holds_every_step_the_config_and_is_finished(logged):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(logged["uri"])
    experiment = client.get_experiment_by_name("raypipe-tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "loggers-test" and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3]
    assert [m.value for m in losses] == pytest.approx([m["loss"] for m in logged["history"]], rel=1e-9)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")] == [(3, 0.25)]
    forward = client.get_metric_history(run.info.run_id, "stage1/forward_s")
    assert [m.value for m in forward] == pytest.approx([m["stages"][1]["forward_s"] for m in logged["history"]])
    params = run.data.params
    assert params["pp"] == "2" and params["microbatches"] == "2" and params["optimizer.lr"] == "0.05"
    assert params["run_name"] == "loggers-test" and params["plan"] == str([list(p) for p in logged["plan"]])


def wandb_records(path):
    """The records of an offline W&B run file: W&B's 7-byte header, then LevelDB log blocks of 32 KiB
    (each record: CRC, length, type FULL/FIRST/MIDDLE/LAST), each record a protobuf `Record`."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", data[:8]
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records):
    """The logged rows (`_step` and the values) of W&B's history records."""
    return [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def test_wandb_offline_run_holds_every_step_and_the_config(logged):
    (path,) = glob.glob(str(logged["root"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "loggers-test" and run.project == "raypipe-tests"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["pp"] == 2 and config["optimizer"]["lr"] == 0.05 and config["run_name"] == "loggers-test"
    rows = history(records)
    losses = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert list(losses) == [1, 2, 3]
    assert list(losses.values()) == pytest.approx([m["loss"] for m in logged["history"]], rel=1e-6)
    assert [row["val/loss"] for row in rows if "val/loss" in row] == [0.25]
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished at shutdown


def test_tensorboard_still_writes_to_log_dir_beside_them(logged):
    events = tensorboard_run(str(logged["root"] / "tb"))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["loss"] for m in logged["history"]])
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(3, 0.25)]


def test_replayed_steps_are_sent_to_wandb_once(tmp_path):
    """After a recovery `fit` replays steps from the checkpoint; W&B keeps steps increasing, so the
    logger sends only steps it has not passed (the replayed values are the same)."""
    logger = loggers_module.WandbLogger("replay", {"pp": 1}, mode="offline", dir=str(tmp_path))
    for step in (1, 2, 3, 2, 3, 4):
        logger.log(step, {"train/loss": float(step)})
    logger.close()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows, deadline = [], time.monotonic() + 30
    while len(rows) < 4 and time.monotonic() < deadline:  # W&B's service may write after finish() returns
        rows = history(wandb_records(path))
        time.sleep(0 if len(rows) >= 4 else 0.2)
    assert [(row["_step"], row["train/loss"]) for row in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]


@pytest.mark.parametrize(
    "loggers, message",
    [
        ("mlflow", "give a list of logger names"),
        (["tensorbord"], "Did you mean 'tensorboard'"),
        (["mlflow", "mlflow"], "'mlflow' is listed twice"),
        ([{"mlflow": {"uri": "x"}}], "mlflow takes the options tracking_uri, experiment, not uri"),
        ([{"wandb": "offline"}], "give each logger as its name, or as {name: {option: value}}"),
    ],
)
def test_bad_loggers_are_refused_naming_the_fix(loggers, message):
    with pytest.raises(ConfigError, match="TrainConfig.loggers") as error:
        TrainConfig(loggers=loggers)
    assert message in str(error.value)


def test_a_logger_that_is_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(logger_table.LOGGERS, "wandb", ("raypipe_no_such_module", "wandb", ("mode",)))
    with pytest.raises(
        ConfigError, match=r"needs the raypipe_no_such_module package.*pip install 'raypipe-train\[wandb\]'"
    ):
        TrainConfig(loggers=["tensorboard", "wandb"])


def test_scalars_flatten_every_stage_and_moe_metric():
    stage = {
        "forward_s": 1.0,
        "backward_s": 2.0,
        "bubble": 0.5,
        "peak_memory_bytes": 7.0,
        "peak_stashed_microbatches": 2,
        "peak_awaiting_weight_grad": 0,
        "sent_bytes": 64,
        "all_to_all_s": 0.1,
        "all_to_all_bytes": 99,
        "experts": {3: {"routed": [5, 6], "dropped": 1}},
    }
    tags = loggers_module.scalars(
        {
            "loss": 2.0,
            "lr": 0.1,
            "grad_norm": 3.0,
            "tokens_per_s": 10.0,
            "samples_per_s": 1.0,
            "step_time": 0.2,
            "stages": [stage],
        }
    )
    assert tags == {
        "train/loss": 2.0,
        "train/lr": 0.1,
        "train/grad_norm": 3.0,
        "train/tokens_per_s": 10.0,
        "train/step_time": 0.2,
        "stage0/forward_s": 1.0,
        "stage0/backward_s": 2.0,
        "stage0/bubble_fraction": 0.5,
        "stage0/peak_memory_bytes": 7.0,
        "stage0/peak_stashed_microbatches": 2.0,
        "stage0/peak_awaiting_weight_grad": 0.0,
        "stage0/sent_bytes": 64.0,
        "stage0/all_to_all_s": 0.1,
        "stage0/all_to_all_bytes": 99.0,
        "moe/layer3/expert0_tokens": 5.0,
        "moe/layer3/expert1_tokens": 6.0,
        "moe/layer3/dropped_tokens": 1.0,
    }
