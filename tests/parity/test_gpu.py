"""On a real GPU (skipped without one), against one process on the CPU: two stages sharing the
GPU under both engines link through host memory and train with parity; two replicas sharing it
reduce over gloo; NCCL links between stages sharing a GPU are refused with the fix; with two
GPUs or more, stages on GPUs of their own link over NCCL, device to device, with parity."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parents[1]

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_stages_on_gpus_train_like_one_process_over_the_link_their_gpus_allow():
    result = subprocess.run(
        [sys.executable, str(HERE / "gpu_run.py")], capture_output=True, text=True, timeout=600, cwd=HERE.parent
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["kind"] in ("cuda", "rocm")
    for name, run in out["runs"].items():
        assert all(d == "cuda:0" for d in run["devices"]) and not any(run["cpu_fallback"]), name
        assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-4, abs=1e-4), name
        assert run["max_weight_diff"] < 1e-4, name
    shared = out["runs"]["shared-p2p"]
    assert shared["gpus"][0] == shared["gpus"][1]
    assert shared["links"] == [{"stage1-dp0-tp0": "shm"}, {"stage0-dp0-tp0": "shm"}]
    assert "share one GPU" in out["refused"] and "device_links='auto'" in out["refused"]
    if out["gpus"] >= 2:
        for engine in ("p2p", "compiled"):
            run = out["runs"][f"nccl-{engine}"]
            assert run["gpus"][0] != run["gpus"][1]
            assert run["links"] == [{"stage1-dp0-tp0": "nccl"}, {"stage0-dp0-tp0": "nccl"}], engine
