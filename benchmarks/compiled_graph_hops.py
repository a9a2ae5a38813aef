"""What a hop between actors costs: plain actor calls vs a Ray Compiled Graph, same work.

p = 4 actors in a chain, m = 16 microbatches of a (2, 8) tensor, each call adds 1 (no
compute): the step is pure dispatch. Plain: every call submitted at once with
`.remote()`, references chained through the driver (raypipe's engine today).
Compiled: the same DAG bound with `ray.dag` and `experimental_compile()`, which
passes tensors through shared-memory channels. The question it answers: how much
of raypipe's per-hop gap (docs/BENCHMARKS.md, schedule efficiency) a Compiled
Graphs engine would remove on this machine.

    python benchmarks/compiled_graph_hops.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import ray
import torch
from ray.dag import InputNode, MultiOutputNode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

P, M, RUNS = 4, 16, 10


@ray.remote(num_cpus=0.01)
class Hop:
    def f(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def timed(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    actors = [Hop.remote() for _ in range(P)]
    x = torch.zeros(2, 8)

    def plain():
        outs = []
        for _ in range(M):
            ref = x
            for actor in actors:
                ref = actor.f.remote(ref)
            outs.append(ref)
        return ray.get(outs)

    with InputNode() as inp:
        outs = []
        for _ in range(M):
            node = inp
            for actor in actors:
                node = actor.f.bind(node)
            outs.append(node)
        compiled = MultiOutputNode(outs).experimental_compile()
    plain_s = timed(plain)
    compiled_s = timed(lambda: ray.get(compiled.execute(x)))
    compiled.teardown()
    ray.shutdown()
    calls = M * P
    json_out.emit(
        {
            "benchmark": "compiled_graph_hops",
            "p": P,
            "m": M,
            "calls": calls,
            "plain_step_ms": 1000 * plain_s,
            "compiled_step_ms": 1000 * compiled_s,
            "plain_us_per_call": 1e6 * plain_s / calls,
            "compiled_us_per_call": 1e6 * compiled_s / calls,
            "compiled_over_plain": compiled_s / plain_s,
        },
        indent=1,
    )


if __name__ == "__main__":
    json_out.run(main)
