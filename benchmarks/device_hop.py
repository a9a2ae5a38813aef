"""One boundary hop between two stage actors, over every link this machine offers, side by side.

Two actors join a 2-rank world as a trainer's neighbouring stages do, and hold every link at
once: a shared-memory link and gloo (through host memory), and a pair of ordered streams of
their own (`transport.ordered`): NCCL when each actor holds a GPU of its own, gloo on CPU
(where it checks the script and the protocol's cost). Rank 0 sends a boundary tensor, rank 1
sends it straight back, `--messages` times per round, the links taking turns round by round.
On a GPU the value starts and ends on the device, so the host links pay their copies out and
back in (`Executor.received` does the same in a stage), and the device link pays none.
Reports the median one-way hop (half a round trip) per link and size.

    python benchmarks/device_hop.py [--sizes-mb 1 6 64 --rounds 5 --messages 20]

Two actors get a GPU each where there are two (`num_gpus=1`); with one they share it, and the
NCCL link is left out: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from raypipe import driver
from raypipe.transport.ray_store import StoreKeeper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


@ray.remote
class End:
    """One end of the links; rank 0 times round trips, rank 1 echoes."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.address = None

    def info(self):
        from raypipe.actors.stage_model import gpu_identity

        return {
            "device": str(self.device),
            "gpu": gpu_identity(self.device),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def join(self, keeper: Any, rank: int, backend: str) -> list[str]:
        from raypipe.transport import ordered, shm
        from raypipe.transport.collective import join_world

        self.rank = rank
        forward, back = join_world(keeper, 2, rank, [[0, 1], [0, 1]], timeout=120, backends=[backend] * 2)
        on = self.device if backend == "nccl" else torch.device("cpu")
        self.streams = {"to1": (forward, on), "to0": (back, on)}
        ordered.warm_up([(0, forward, [0, 1]), (1, back, [1, 0])], rank, on)
        linked = shm.connect(rank, [1 - rank], timeout=120)
        return ["shm", "gloo", f"{backend} (ordered)"] if linked else ["gloo", f"{backend} (ordered)"]

    def run(self, link: str, nbytes: int, messages: int) -> list[float]:
        """One round: `messages` round trips of a float32 tensor of `nbytes` over `link`; rank 0
        returns each round trip's seconds."""
        from raypipe.transport import inbox, outbox
        from raypipe.transport.gloo import GlooInbox, GlooOutbox

        peer = 1 - self.rank
        if link == "gloo":  # gloo itself, though the shared-memory link is open
            out, box = GlooOutbox(peer), GlooInbox(peer, list(range(messages)))
        else:
            ordered = link.endswith("(ordered)")
            mine, theirs = ("to1", "to0") if self.rank == 0 else ("to0", "to1")
            out = outbox(peer, messages, stream=self.streams[mine] if ordered else None)
            box = inbox(peer, list(range(messages)), stream=self.streams[theirs] if ordered else None)
        value = torch.randn(nbytes // 4, device=self.device)
        times = []
        for i in range(messages):
            started = time.perf_counter()
            if self.rank == 0:
                out.send(value, i)
            got = box.take().to(self.device)  # a stage computes on its device (a no-op on the device link)
            if self.rank == 1:
                out.send(got, i)
            box.refill()
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()  # the value is usable: its copies are done
            times.append(time.perf_counter() - started)
        out.wait()
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 6, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=20, help="round trips per round")
    args = parser.parse_args()
    driver.connect()
    gpus = torch.cuda.device_count()
    device = "cuda:0" if gpus else "cpu"
    per_actor = 1 if gpus >= 2 else 0.5 if gpus else 0
    ends = [End.options(num_gpus=per_actor, num_cpus=0.5).remote(device) for _ in range(2)]
    infos = ray.get([e.info.remote() for e in ends], timeout=120)
    own_gpus = gpus >= 2 and infos[0]["gpu"] != infos[1]["gpu"]
    keeper = ray.remote(StoreKeeper).remote()
    links = ray.get(
        [e.join.remote(keeper, r, "nccl" if own_gpus else "gloo") for r, e in enumerate(ends)], timeout=300
    )[0]
    hops: dict[str, dict[str, list[float]]] = {link: {} for link in links}
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20) // 4 * 4
        for _ in range(args.rounds):
            for link in links:  # the links take turns, round by round
                times, _ = ray.get([e.run.remote(link, nbytes, args.messages) for e in ends], timeout=600)
                hops[link].setdefault(f"{mb:g}MB", []).extend(t / 2 for t in times[1:])  # the first warms up
    ray.shutdown()
    json_out.emit(
        {
            "benchmark": "device_hop",
            "device": torch.cuda.get_device_name(0) if gpus else "cpu",
            "actors_hold_own_gpus": own_gpus,
            "gpus": gpus,
            "rounds": args.rounds,
            "messages": args.messages,
            "hop_ms_median": {
                link: {size: round(1e3 * statistics.median(v), 4) for size, v in sizes.items()}
                for link, sizes in hops.items()
            },
        },
        indent=1,
    )


if __name__ == "__main__":
    json_out.run(main)
