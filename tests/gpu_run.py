"""Run by tests/parity/test_gpu.py on a machine with a GPU, in its own process and its own local Ray
(which advertises the GPU as `raypipe node-resources` would), against one process on the CPU.
Prints one JSON object.

Cases: two stages sharing the GPU under both engines (their link goes through host memory:
NCCL refuses two ranks on one GPU); two replicas sharing it (their dp group reduces over gloo);
`device_links="nccl"` on a shared GPU refused; and with two GPUs or more, two stages on GPUs of
their own linked over NCCL, device to device."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import ray  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from raypipe import PlacementError, TrainConfig, Trainer, driver  # noqa: E402
from raypipe.core.devices import detect  # noqa: E402

from helpers import MLP7, batch, reference_run  # noqa: E402

SEED = 5
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def run(kind: str, name: str, microbatches: int = 4, **kwargs) -> dict:
    config = TrainConfig(
        microbatches=microbatches, devices=kind, seed=SEED, optimizer=SGD, name=f"gpu-{name}", **kwargs
    )
    with Trainer(MLP7, nn.functional.mse_loss, config) as trainer:
        info = trainer.stage_info()
        losses = [trainer.step(*batch(k))["loss"] for k in range(3)]
        final = trainer.state_dict()
    ref_losses, _, ref_final = reference_run(
        MLP7, SEED, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=3, microbatches=microbatches
    )
    return {
        "devices": [i["device"] for i in info],
        "cpu_fallback": [i["cpu_fallback"] for i in info],
        "gpus": [i["gpu"] for i in info],
        "links": [i["links"] for i in info],
        "losses": losses,
        "ref_losses": ref_losses,
        "max_weight_diff": max(float((final[k].cpu() - ref_final[k]).abs().max()) for k in ref_final),
    }


def main() -> None:
    kind = detect().kind
    driver.connect()
    out = {"kind": kind, "gpus": torch.cuda.device_count(), "runs": {}}
    try:
        for engine in ("p2p", "refs"):
            out["runs"][f"shared-{engine}"] = run(kind, engine, pp=2, gpus_per_actor=0.5, engine=engine)
        out["runs"]["shared-dp2"] = run(kind, "dp2", pp=1, dp=2, gpus_per_actor=0.5)
        try:
            run(kind, "refused", pp=2, gpus_per_actor=0.5, device_links="nccl")
            out["refused"] = None
        except PlacementError as error:
            out["refused"] = str(error)
        if torch.cuda.device_count() >= 2:
            for engine in ("p2p", "compiled"):
                out["runs"][f"nccl-{engine}"] = run(kind, f"nccl-{engine}", pp=2, gpus_per_actor=1, engine=engine)
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
