"""Run by tests/cluster/test_placement.py in its own process: a `ray.cluster_utils.Cluster` of fake
nodes that advertise cuda, rocm and mps (resources and labels, as `raypipe node-resources`
prints them), and raypipe placing one stage on each. Prints one JSON object."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import fork_server  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from torch import nn  # noqa: E402

from raypipe import LayerSpec, PlacementError, StageError, TrainConfig, Trainer  # noqa: E402
from raypipe.core.devices import LABEL_KIND  # noqa: E402
from raypipe.models.simulated import SimulatedCompute  # noqa: E402

from helpers import MLP7, batch, reference_run  # noqa: E402

SEED, SGD = 5, {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def add(cluster, kind):
    cluster.add_node(
        num_cpus=1, num_gpus=1 if kind in ("cuda", "rocm") else 0, resources={kind: 1}, labels={LABEL_KIND: kind}
    )


def balance() -> dict:
    """Step times of a cuda + rocm pipeline whose rocm stage simulates a 2x slower device, split
    uniformly and by profile."""
    layers = [LayerSpec(SimulatedCompute, 0.02, 0.02, slowdown={"rocm": 2.0}) for _ in range(6)]
    x = torch.randn(16, 8)
    result = {}
    for partition in ("uniform", "profile"):
        config = TrainConfig(
            pp=2,
            devices=["cuda", "rocm"],
            allow_cpu_fallback=True,
            cpus_per_actor=0.25,
            microbatches=8,
            partition=partition,
            optimizer={"name": "sgd", "lr": 0.01},
        )
        with Trainer(layers, nn.functional.mse_loss, config, sample=(x, x), log=lambda _: None) as trainer:
            trainer.step(x, x)  # warm-up
            # the best of 3: one step slowed by a noisy machine must not decide (a best of 2 flaked in CI)
            times = sorted(trainer.step(x, x)["step_time"] for _ in range(3))
            result[partition] = {"plan": trainer.plan, "step_time": times[0]}
            if trainer.plan_report is not None:
                result[partition]["predicted"] = trainer.plan_report.step_seconds
    return result


def lora_job(kinds: dict) -> dict:
    """The LoRA SFT example job with its stages on a cuda node (4-bit base) and an mps node (bf16
    has no meaning on a fake mps node's CPU, so fp32): where they landed, and the losses."""
    import tempfile

    from raypipe.job import JobConfig, run

    from hf_helpers import save_tiny

    base = save_tiny(
        "llama", tempfile.mkdtemp(prefix="hetero-lora-"), vocab_size=256, hidden_size=64, intermediate_size=128
    )
    overrides = [
        f"model.hf={base}",
        "model.block_size=32",
        "job.steps=3",
        "job.eval_every=0",
        "job.eval_batches=1",
        "job.batch_size=4",
        "job.sample_tokens=0",
        "data.max_bytes=200000",
        "log_dir=null",
        "job.progress=false",
        "job.save_adapter=null",
        "job.save_pretrained=null",
        "devices=[cuda, mps]",
        "quantize=[nf4, null]",
        "allow_cpu_fallback=true",
        "cpus_per_actor=0.25",
        "threads_per_actor=1",
    ]
    lines = []
    summary = run(JobConfig.from_yaml("examples/configs/lora_sft.yaml", overrides), log=lines.append)
    return {"losses": summary["losses"], "log": lines}


def main() -> None:
    fork_server.use_interpreter()  # the Cluster's nodes fork their workers too, under pytest
    out = {}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        add(cluster, "cuda")
        add(cluster, "rocm")
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        config = dict(
            pp=3,
            devices=["cuda", "rocm", "mps"],
            allow_cpu_fallback=True,
            cpus_per_actor=0.25,
            optimizer=SGD,
            seed=SEED,
            microbatches=2,
        )
        started = time.monotonic()
        try:  # no node has mps yet
            Trainer(MLP7, nn.functional.mse_loss, TrainConfig(**config, actor_start_timeout=6))
        except PlacementError as error:
            out["placement_error"], out["placement_seconds"] = str(error), time.monotonic() - started
        try:  # a cuda stage on a node whose torch has no CUDA, without permission to fall back
            Trainer(MLP7, nn.functional.mse_loss, TrainConfig(pp=1, devices="cuda", cpus_per_actor=0.25))
        except StageError as error:
            out["no_fallback_error"] = str(error)
        add(cluster, "mps")
        kinds = {n["NodeID"]: n["Labels"].get(LABEL_KIND) for n in ray.nodes() if n["Alive"]}
        with Trainer(MLP7, nn.functional.mse_loss, TrainConfig(**config)) as trainer:
            info = trainer.stage_info()
            out["placed"] = [
                {
                    "name": i["name"],
                    "node_kind": kinds[i["node_id"]],
                    "device_kind": i["device_kind"],
                    "device": i["device"],
                    "cpu_fallback": i["cpu_fallback"],
                }
                for i in info
            ]
            out["losses"] = [trainer.step(*batch(k))["loss"] for k in range(3)]
            final = trainer.state_dict()
        out["balance"] = balance()
        out["lora_job"] = lora_job(kinds)
        ref_losses, _, ref_final = reference_run(
            MLP7, SEED, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), steps=3, microbatches=2
        )
        out["ref_losses"] = ref_losses
        out["max_weight_diff"] = max(float((final[k] - ref_final[k]).abs().max()) for k in ref_final)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
