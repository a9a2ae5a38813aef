"""Time from a stage actor's death to training going on again.

Trains a small pipeline with checkpoints every step, kills stage 1 with SIGKILL in
the middle of a step, and reports (JSON) how long the trainer took to notice the
death, and how long until the step that died had completed on new actors.

    python benchmarks/recovery_time.py --trials 3
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from torch import nn

from raypipe import LayerSpec, TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


class SlowIdentity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    layers = [LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Tanh), LayerSpec(SlowIdentity), LayerSpec(nn.Linear, 8, 2)]
    data = lambda k: (torch.randn(8, 8, generator=torch.Generator().manual_seed(k)), torch.zeros(8, 2))
    trials = []
    for _ in range(args.trials):
        with tempfile.TemporaryDirectory() as root:
            config = TrainConfig(
                pp=2,
                microbatches=2,
                checkpoint_dir=root,
                checkpoint_every=1,
                max_restarts=1,
                optimizer={"name": "sgd", "lr": 0.01},
            )
            events: dict[str, float] = {}
            with Trainer(layers, nn.functional.mse_loss, config) as trainer:
                pid = trainer.stage_info()[1]["pid"]

                def on_step(metrics):
                    if metrics["step"] == 3 and "killed" not in events:

                        def kill():
                            events["killed"] = time.monotonic()
                            os.kill(pid, signal.SIGKILL)

                        threading.Timer(0.03, kill).start()  # inside step 4's first forward on stage 1
                    if "killed" in events and "noticed" in events and "going_on" not in events:
                        events["going_on"] = time.monotonic()

                def log(line):
                    if "died during" in line:
                        events["noticed"] = time.monotonic()

                trainer.fit(data, 6, on_step=on_step, log=log)
            trials.append(
                {
                    "death_noticed_s": events["noticed"] - events["killed"],
                    "death_to_next_completed_step_s": events["going_on"] - events["killed"],
                }
            )
    ray.shutdown()
    json_out.emit({"benchmark": "recovery_time", "cpus": 2, "pp": 2, "trials": trials}, indent=2)


if __name__ == "__main__":
    json_out.run(main)
