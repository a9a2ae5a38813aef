"""Strangers on a trainer's ports (issue 75): what a process on the network that is not a member can
do to a pp 2 x dp 2 trainer while it trains and while it saves a checkpoint.

The check finds every TCP port the actors listen on (psutil, the actors' processes), tells Ray's
own (the core worker's, token-authenticated) from the world's, and then, from this process,
connects to each of the world's ports three times: a crafted pickle that would create a marker file
if anything loaded it, 4 KiB of random bytes, and a connection opened and left idle. With them all
connected the trainer takes `--steps` steps, saves a checkpoint (ZeRO-1: the save gathers optimizer
shards over the world), loads it back and takes two more steps. An untouched trainer does the same.
The report: the ports per actor, whether any looks like a rendezvous store (a port listening on
every interface that is not Ray's), whether the marker file appeared, the largest difference between
the two runs' weights (0.0 is exact) and each run's step times.

    .venv/bin/python benchmarks/strangers.py > strangers.json      # ~40 s
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

from raypipe import TrainConfig, Trainer  # noqa: E402

from toy_models import MLP7, batch  # noqa: E402


class Marker:
    """A pickle that creates a file when loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def ports_of(trainer: Trainer) -> dict[str, dict[str, list[str]]]:
    """Per actor: Ray's own listening port and every other one, as "host:port"."""
    out = {}
    for info, handle in zip(trainer.stage_info(), trainer.group.actors):
        rays = ray._private.state.actors(handle._actor_id.hex())["Address"]["Port"]
        listens = [
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process(info["pid"]).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN
        ]
        out[info["name"]] = {
            "ray": [a for a in listens if a.endswith(f":{rays}")],
            "world": sorted(a for a in listens if not a.endswith(f":{rays}")),
            "reported": info["listening"],
        }
    return out


def train(trainer: Trainer, steps: int, folder: str) -> list[float]:
    seconds = []
    for k in range(steps):
        started = time.perf_counter()
        trainer.step(*batch(k))
        seconds.append(time.perf_counter() - started)
    trainer.load(str(trainer.save(folder)), log=lambda line: None)
    for k in range(steps, steps + 2):
        trainer.step(*batch(k))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False)
    config = TrainConfig(pp=2, dp=2, microbatches=4, optimizer={"name": "sgd", "lr": 0.05, "momentum": 0.9}, zero=1)
    work = Path(tempfile.mkdtemp(prefix="raypipe-strangers-"))
    marker = work / "ran"
    report: dict = {"steps": args.steps}
    results = {}
    for attacked in (False, True):
        trainer = Trainer(MLP7, nn.functional.mse_loss, config.replace(seed=7), log=lambda line: None)
        strangers = []
        try:
            if attacked:
                report["ports"] = ports_of(trainer)
                for k, address in enumerate(a for p in report["ports"].values() for a in p["world"] for _ in range(3)):
                    host, port = address.rsplit(":", 1)
                    strangers.append(socket.create_connection((host, int(port)), timeout=10))
                    strangers[-1].sendall([pickle.dumps(Marker(str(marker))), os.urandom(4096), b""][k % 3])
                report["connections"] = len(strangers)
            seconds = train(trainer, args.steps, str(work / ("attacked" if attacked else "untouched")))
            results[attacked] = (trainer.state_dict(), seconds)
        finally:
            for s in strangers:
                s.close()
            trainer.shutdown()
    (clean, clean_s), (hit, hit_s) = results[False], results[True]
    report["max_weight_difference"] = max(float((clean[k] - hit[k]).abs().max()) for k in clean)
    report["marker_file_appeared"] = marker.exists()
    report["wildcard_ports_besides_rays"] = [
        a for p in report["ports"].values() for a in p["world"] if a.startswith(("0.0.0.0:", ":::"))
    ]
    report["step_ms_median"] = {
        "untouched": 1000 * statistics.median(clean_s[1:]),
        "with_strangers": 1000 * statistics.median(hit_s[1:]),
    }
    json_out.emit(report, indent=1)
    torch.set_num_threads(1)  # nothing more to compute; keeps the interpreter's exit quick


if __name__ == "__main__":
    json_out.run(main)
