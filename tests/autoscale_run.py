"""Run by tests/cluster/test_autoscaling.py in its own process: Ray's fake multi-node autoscaler with the
node types of examples/clusters/aws-nvidia-amd.yaml, and a pipeline needing a cuda and a rocm
stage. Starts `RAY_FAKE_CLUSTER=1 ray start --head --block --autoscaling-config=...` on free
ports, trains one step, reports which node types came up, and stops every process it started
(the head's process group, and any process the autoscaler spawned under it). Prints one JSON object."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import torch
import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from raypipe import TrainConfig, Trainer  # noqa: E402
from raypipe.core.devices import LABEL_KIND  # noqa: E402

from helpers import MLP7, batch  # noqa: E402

HEAD_TYPE = "ray.head.default"  # the fake provider's name for the head node type


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_config(port: int, ip: str) -> dict:
    """The cloud example with its node types kept (resources, labels) and a fake provider."""
    config = yaml.safe_load((ROOT / "examples/clusters/aws-nvidia-amd.yaml").read_text())
    types = config["available_node_types"]
    head = types.pop(config["head_node_type"])
    types[HEAD_TYPE] = {**head, "resources": {"CPU": 1}}
    for node_type in types.values():
        node_type["node_config"] = {}
    config["head_node_type"] = HEAD_TYPE
    # As Ray's own fake_multi_node/example.yaml: the autoscaler keys heartbeats by node id (every
    # fake node shares one IP), or it terminates a worker 30 s after launch as "lost contact".
    config["provider"] = {
        "type": "fake_multinode",
        "gcs_address": f"{ip}:{port}",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    }
    config["idle_timeout_minutes"] = 5
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands", "file_mounts"):
        config[key] = [] if key != "file_mounts" else {}
    return config


def main() -> None:
    ip = ray.util.get_node_ip_address()
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rpa-", dir="/tmp")
    config_path = Path(temp) / "autoscaling.yaml"
    config_path.write_text(yaml.safe_dump(fake_config(port, ip)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_FAKE_CLUSTER="1", RAY_AUTH_MODE="disabled", RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=1",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
            "--include-dashboard=false",
            f"--autoscaling-config={config_path}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = {}
    spawned: set[int] = set()
    try:
        os.environ["RAY_AUTH_MODE"] = "disabled"
        deadline = time.monotonic() + 90
        while True:
            try:
                ray.init(address=f"{ip}:{port}", logging_level="ERROR", log_to_driver=False)
                break
            except Exception:
                if time.monotonic() > deadline or head.poll() is not None:
                    raise RuntimeError(f"the fake head did not come up: {Path(log.name).read_text()[-3000:]}")
                time.sleep(2)
        out["nodes_before"] = sum(n["Alive"] for n in ray.nodes())
        config = TrainConfig(
            pp=2,
            devices=["cuda", "rocm"],
            allow_cpu_fallback=True,
            cpus_per_actor=1,
            microbatches=2,
            optimizer={"name": "sgd", "lr": 0.05},
            actor_start_timeout=180,
        )
        started = time.monotonic()
        with Trainer(MLP7, nn.functional.mse_loss, config) as trainer:
            out["placed_seconds"] = time.monotonic() - started
            spawned |= {p.pid for p in psutil.Process(head.pid).children(recursive=True)}
            kinds = {n["NodeID"]: n["Labels"].get(LABEL_KIND) for n in ray.nodes() if n["Alive"]}
            out["stage_node_kinds"] = [kinds[i["node_id"]] for i in trainer.stage_info()]
            out["loss"] = trainer.step(*batch(0))["loss"]
        out["worker_kinds"] = sorted(
            n["Labels"].get(LABEL_KIND, "?")
            for n in ray.nodes()
            if n["Alive"] and n["NodeManagerAddress"] and n["Resources"].get("GPU")
        )
        out["loss_is_finite"] = bool(torch.isfinite(torch.tensor(out["loss"])))
    finally:
        ray.shutdown()
        try:
            spawned |= {p.pid for p in psutil.Process(head.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        head.terminate()  # `ray start --block` stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        for group_or_pid in [-head.pid, *spawned]:  # what is left: its group, then the autoscaler's nodes
            try:
                (
                    os.killpg(-group_or_pid, signal.SIGKILL)
                    if group_or_pid < 0
                    else os.kill(group_or_pid, signal.SIGKILL)
                )
            except (ProcessLookupError, PermissionError):
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
