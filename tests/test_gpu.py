"""On a real GPU (skipped without one): two stages share the GPU, for both engines, and train
with parity to one process on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_two_stages_on_one_gpu_train_like_one_process():
    result = subprocess.run([sys.executable, str(HERE / "gpu_run.py")], capture_output=True, text=True,
                            timeout=400, cwd=HERE.parent)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["kind"] in ("cuda", "rocm")
    for engine, run in out["runs"].items():
        assert run["devices"] == ["cuda:0", "cuda:0"] and run["cpu_fallback"] == [False, False], engine
        assert run["losses"] == pytest.approx(run["ref_losses"], rel=1e-4, abs=1e-4), engine
        assert run["max_weight_diff"] < 1e-4, engine
