"""Run by tests/test_gpu.py on a machine with a GPU, in its own process and its own local Ray
(which advertises the GPU as `raypipe node-resources` would): two stages sharing the GPU,
both engines, against one process on the CPU. Prints one JSON object."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from helpers import MLP7, batch, reference_run  # noqa: E402
from raypipe import TrainConfig, Trainer, runtime  # noqa: E402
from raypipe.devices import detect  # noqa: E402

SEED = 5


def main() -> None:
    kind = detect().kind
    runtime.connect()
    out = {"kind": kind, "runs": {}}
    try:
        for engine in ("p2p", "refs"):
            config = TrainConfig(pp=2, microbatches=4, devices=kind, gpus_per_actor=0.5, engine=engine, seed=SEED,
                                 optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, name=f"gpu-{engine}")
            with Trainer(MLP7, nn.functional.mse_loss, config) as trainer:
                info = trainer.stage_info()
                losses = [trainer.step(*batch(k))["loss"] for k in range(3)]
                final = trainer.state_dict()
            ref_losses, _, ref_final = reference_run(
                MLP7, SEED, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=3, microbatches=4)
            out["runs"][engine] = {
                "devices": [i["device"] for i in info], "cpu_fallback": [i["cpu_fallback"] for i in info],
                "losses": losses, "ref_losses": ref_losses,
                "max_weight_diff": max(float((final[k].cpu() - ref_final[k]).abs().max()) for k in ref_final),
            }
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
