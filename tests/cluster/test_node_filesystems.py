"""Checkpoints on nodes that do not share a filesystem (issue 22): a real two-node Ray cluster on this
machine, the worker node started in a mount namespace of its own (`unshare -m`) where the checkpoint
directory is a private tmpfs, as on a second machine. A trainer with a stage on that node stops
before training with an error naming the stage, its node and the fixes; with a directory both
nodes share it trains and saves."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from ray_head import RAY, RayHead, head_env

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a node with a filesystem of its own needs a mount namespace: root and unshare",
)

DRIVER = """
import json, ray
from torch import nn
from raypipe import CheckpointError, LayerSpec, TrainConfig, Trainer
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
layers = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 2)]
out = {{}}
for name, root in (("private", "{private}/ck"), ("shared", "{shared}/ck")):
    config = TrainConfig(pp=2, devices=["cpu", "mps"], allow_cpu_fallback=True, cpus_per_actor=0.25,
                         placement="strict_spread", checkpoint_dir=root, checkpoint_every=1, actor_start_timeout=90,
                         name=f"fs-{{name}}")
    try:
        with Trainer(layers, nn.functional.mse_loss, config) as t:
            import torch
            t.fit(lambda k: (torch.randn(8, 4), torch.randn(8, 2)), 2)
            out[name] = {{"nodes": sorted({{i["node_id"] for i in t.stage_info()}}), "saved": t.step_count}}
    except CheckpointError as error:
        out[name] = {{"error": str(error)}}
print("RESULT " + json.dumps(out))
"""


def test_a_node_that_cannot_see_the_checkpoint_dir_stops_the_trainer_before_training(tmp_path):
    private = Path(tempfile.mkdtemp(prefix="rp-private-", dir="/tmp"))  # the worker node mounts a tmpfs here
    shared = tmp_path / "shared"
    shared.mkdir()
    env = head_env()
    head = RayHead("", env, tmp_path / "head.log", num_cpus=1)
    worker, leftovers = None, []
    try:
        head.wait_gcs()
        # the worker node: its own mount namespace with a private tmpfs over `private`, advertising mps
        command = (
            f"mount -t tmpfs tmpfs {private} && exec {RAY} start --address={head.address} --block "
            f"--num-cpus=1 --disable-usage-stats $(raypipe node-resources)"
        )
        log = open(tmp_path / "worker.log", "w")
        worker = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", command],
            env={**env, "RAYPIPE_FAKE_ACCELERATOR": "mps:1:Apple M3 Max"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        probe = f"import ray; ray.init(address='{head.address}', logging_level='ERROR'); print(len(ray.nodes()))"
        deadline = time.monotonic() + 120
        while head.run_python(probe).stdout.strip().splitlines()[-1:] != ["2"]:
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker node did not join"
            time.sleep(1)
        run = head.run_python(DRIVER.format(address=head.address, private=private, shared=shared), timeout=300)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        assert lines, run.stdout[-3000:] + run.stderr[-3000:]
        result = json.loads(lines[-1][len("RESULT ") :])
    finally:
        if worker is not None:
            try:
                os.killpg(worker.pid, signal.SIGTERM)
                worker.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(worker.pid, signal.SIGKILL)
        head.stop()
        leftovers = list(private.glob("ck/step-*"))  # as the driver's node sees it
        shutil.rmtree(private, ignore_errors=True)
    error = result["private"].get("error", "")
    assert "stage1-dp0-tp0 (node" in error and "cannot read checkpoint_dir" in error, result
    assert "s3://bucket/run" in error and "nothing was lost" in error
    assert not leftovers, leftovers  # stopped before any step: no checkpoint was begun
    assert result["shared"]["saved"] == 2 and len(result["shared"]["nodes"]) == 2, result  # both nodes, both saved
    assert sorted(p.name for p in (shared / "ck").iterdir()) == ["step-00000001", "step-00000002"]
