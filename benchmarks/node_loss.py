"""Time from losing a whole node to the next completed step, on a real cluster of four Ray nodes
in network namespaces on this machine (`tests/netns_cluster.py`; needs root and `ip netns`).

Each round trains pp = 2 (cpu, mps) with a checkpoint every 2 steps, SIGKILLs every process of
the node holding the mps stage after step 5 and times until a step completes on the spare mps
node; then a new mps node is started so the next round has a spare again. JSON out.

    sudo .venv/bin/python benchmarks/node_loss.py --rounds 3 --out node_loss.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from test_netns_cluster import LOSS_RUN, MPS, PRELUDE, drive  # noqa: E402

from netns_cluster import NetnsCluster, available  # noqa: E402

ROUND = (
    PRELUDE
    + LOSS_RUN
    + """
result = run(8, 5, 90)
result["recovery_log"] = [line for line in result["log"] if "resumed at" in line or "lost node" in line]
print("RESULT " + json.dumps({{k: result[k] for k in ("resumed", "restarts", "lost", "after", "recovery_log")}}))
"""
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    reason = available()
    if reason:
        sys.exit(f"cannot run: {reason}")
    work = Path(tempfile.mkdtemp(prefix="node-loss-"))
    cluster = NetnsCluster(work)
    rounds = []
    try:
        for name, kind in [("head", None), ("cpu", None), ("mps-a", MPS), ("mps-b", MPS)]:
            cluster.start_node(name, num_cpus=1, fake_accelerator=kind)
            cluster.wait_nodes()
        for r in range(args.rounds):
            result = drive(cluster, ROUND, work)
            rounds.append(result)
            print(
                f"round {r + 1}: lost {result['lost']}, next step {result['resumed']:.2f} s after the kill", flush=True
            )
            lost = next(name for name, node in cluster.nodes.items() if node.ip == result["lost"])
            cluster.nodes.pop(lost)  # its namespace goes at close(), with the others
            cluster.start_node(f"mps-{r}", num_cpus=1, fake_accelerator=MPS)  # a spare for the next round
            cluster.wait_nodes()
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    seconds = [r["resumed"] for r in rounds]
    report = {
        "benchmark": "node_loss",
        "rounds": rounds,
        "kill_to_next_step_s": seconds,
        "median_s": statistics.median(seconds),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
