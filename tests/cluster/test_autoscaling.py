"""Autoscaling on node types: Ray's fake multi-node provider launches exactly the node types
(from examples/clusters/aws-nvidia-amd.yaml) that a cuda + rocm pipeline asks for."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parents[1]


def test_a_cuda_and_rocm_pipeline_makes_the_autoscaler_launch_those_node_types():
    # not what an earlier test's local Ray put in this process's environment: ray.init sets
    # RAY_AUTH_MODE=token, which Ray reads once at import, and the fake cluster runs without auth
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    result = subprocess.run(
        [sys.executable, str(HERE / "autoscale_run.py")],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=HERE.parent,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["nodes_before"] == 1  # only the head: no GPU node until a stage asks for one
    assert out["worker_kinds"] == ["cuda", "rocm"]  # one node of each type, nothing else
    assert out["stage_node_kinds"] == ["cuda", "rocm"]
    assert out["loss_is_finite"] and out["loss"] > 0
