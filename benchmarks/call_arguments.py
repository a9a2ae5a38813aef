"""What a p2p step's Ray call costs with its eight arguments sent separately vs as one `StepCall`.

Ray serializes every argument of a call on its own. This times, alternating call by
call against one actor, the submission (`.remote()` until it returns) and the round
trip (until `ray.get` returns) of a call carrying what `run_actions` gets: call id,
step, a 32-action list, 16 stacked microbatches, targets, neighbour ranks.

    python benchmarks/call_arguments.py [--calls 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

from raypipe.core.protocol import StepCall
from raypipe.transport.wire import pack_microbatches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402


@ray.remote(num_cpus=0.01)
class Receiver:
    def separate(self, call_id, step, actions, inputs, targets, prev_rank, next_rank, after):  # noqa: PLR0913
        return None, {"call_id": call_id}

    def one(self, call: StepCall):
        return None, {"call_id": call.call_id}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    actor = Receiver.remote()
    actions = [("F", m) for m in range(16)] + [("B", m) for m in range(15, -1, -1)]
    batch = pack_microbatches([torch.randn(1, 8) for _ in range(16)])
    seconds: dict[str, list[float]] = {"separate": [], "one": [], "separate_submit": [], "one_submit": []}
    for k in range(args.calls + 10):
        for kind in ("separate", "one") if k % 2 else ("one", "separate"):
            call = StepCall(
                call_id=k, step=k, actions=actions, inputs=batch, targets=None, peers=None, after=1, varying=None
            )
            started = time.perf_counter()
            ref = actor.separate.remote(*call) if kind == "separate" else actor.one.remote(call)
            submitted = time.perf_counter()
            ray.get(ref)
            if k >= 10:  # warm-up
                seconds[kind + "_submit"].append(submitted - started)
                seconds[kind].append(time.perf_counter() - started)
    ray.shutdown()
    ms = {name: 1000 * statistics.median(v) for name, v in seconds.items()}
    json_out.emit(
        {
            "benchmark": "call_arguments",
            "calls": args.calls,
            "median_ms": {
                "round_trip_separate": ms["separate"],
                "round_trip_one": ms["one"],
                "submit_separate": ms["separate_submit"],
                "submit_one": ms["one_submit"],
            },
        },
        indent=2,
    )


if __name__ == "__main__":
    json_out.run(main)
