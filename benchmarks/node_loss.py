"""Time from losing a whole node to the next completed step, on a real cluster of four Ray nodes
in network namespaces on this machine (`support/netns_cluster.py`; needs root and `ip netns`).

`--case spare`: each round trains pp = 2 (cpu, mps) with a checkpoint every 2 steps, SIGKILLs
every process of the node holding the mps stage after step 5 and times until a step completes
on the spare mps node; then a new mps node is started so the next round has a spare again.

`--case shrink` (issue 38, `TrainConfig.elastic`): no spare. Each round runs
`tests/recovery/test_elastic.py`'s two runs, pp = 3 (cpu, mps, mps) and pp 2 x dp 2 on all four nodes,
kills a node after step 3 and times until a step completes on the shrunk topology (pp = 2,
dp = 1); the node restarted, each grows back at its next checkpoint. `--replace-wait`: the
seconds each waits for a replacement first (part of the time measured). The pp run restores its
checkpoint; the dp run the surviving replica's state (`TrainConfig.restore_from_replicas`).

`--case memory` (issue 38, part 3): each round trains dp = 2 on two of the nodes twice, once
restoring the lost replica from the survivor's memory and once from the last checkpoint
(`restore_from_replicas=False`), kills the node of one replica after step 3 and times until a
step completes again with the new replica on a spare node; the node is restarted after each.
JSON out.

    sudo .venv/bin/python benchmarks/node_loss.py --rounds 3 --out node_loss.json
    sudo .venv/bin/python benchmarks/node_loss.py --case shrink --replace-wait 1 --rounds 2
    sudo .venv/bin/python benchmarks/node_loss.py --case memory --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

SUPPORT = Path(__file__).resolve().parent.parent / "support"  # modules shared with the tests
sys.path.insert(0, str(SUPPORT))

from netns_cluster import MPS, NetnsCluster, available  # noqa: E402
from node_loss_script import ELASTIC, ELASTIC_RUN, LOSS_RUN, PRELUDE, drive  # noqa: E402

ROUND = (
    PRELUDE
    + LOSS_RUN
    + """
result = run(8, 5, 90)
result["recovery_log"] = [line for line in result["log"] if "resumed at" in line or "lost node" in line]
print("RESULT " + json.dumps({{k: result[k] for k in ("resumed", "restarts", "lost", "after", "recovery_log")}}))
"""
)


def shrink_round(cluster: NetnsCluster, work: Path, replace_wait: float) -> dict:
    """One round of `--case shrink`: kill -> next completed step of each elastic run, in seconds."""
    out = run_live(cluster, ELASTIC.replace("replace_wait=5", f"replace_wait={replace_wait}"), work)
    return {case: round(out[case]["resumed"], 2) for case in ("pp", "dp")} | {
        "log": [line for case in ("pp", "dp") for line in out[case]["log"] if "elastic" in line or "resumed" in line]
    }


def memory_round(cluster: NetnsCluster, work: Path) -> dict:
    """One round of `--case memory`: kill -> next completed step from memory and from the checkpoint."""
    code = (
        ELASTIC_RUN
        + """
out = {{}}
for how, restore in (("memory", True), ("checkpoint", False)):
    out[how] = run("replica-" + how, 6, ["stage0-dp1-tp0", "stage0-dp0-tp0"], grow=False, elastic=False, dp=2,
                   microbatches=1, restore_from_replicas=restore)
    time.sleep(8)  # the killed node back as a spare
print("RESULT " + json.dumps(out))
"""
    )
    out = run_live(cluster, code, work)
    return {how: round(out[how]["resumed"], 2) for how in ("memory", "checkpoint")} | {
        "replayed": {how: len(out[how]["steps"]) - 6 for how in ("memory", "checkpoint")},
        "noticed_s": {how: round(out[how]["noticed"], 2) for how in ("memory", "checkpoint")},
        "log": [line for how in ("memory", "checkpoint") for line in out[how]["log"] if "resumed" in line],
    }


def run_live(cluster: NetnsCluster, template: str, work: Path) -> dict:
    """Runs a driver script on the cluster, restarting each node it names on a "RESTART <ip>" line."""

    def on_line(line: str) -> None:
        if line.startswith("RESTART "):
            cluster.restart_node(next(n for n, node in cluster.nodes.items() if node.ip == line.split()[1]))

    namespaces = json.dumps({n.ip: n.name for n in cluster.nodes.values()})
    code = template.format(address=cluster.address, namespaces=namespaces, tmp=work)
    stdout, stderr = cluster.run_python_live(code, on_line, timeout=600, env={"PYTHONPATH": str(SUPPORT)})
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(stdout[-3000:] + stderr[-3000:])
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--case", choices=("spare", "shrink", "memory"), default="spare")
    parser.add_argument("--replace-wait", type=float, default=5.0, help="TrainConfig.replace_wait (--case shrink)")
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
            if args.case in ("shrink", "memory"):
                done = shrink_round(cluster, work, args.replace_wait) if args.case == "shrink" else None
                rounds.append(done or memory_round(cluster, work))
                print(f"round {r + 1}: {rounds[-1]}", flush=True)
                continue
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
    cases = {"spare": ("resumed",), "shrink": ("pp", "dp"), "memory": ("memory",)}[args.case]
    seconds = [r[c] for r in rounds for c in cases]
    report = {
        "benchmark": "node_loss",
        "case": args.case,
        "replace_wait_s": args.replace_wait if args.case == "shrink" else None,
        "rounds": rounds,
        "kill_to_next_step_s": seconds,
        "median_s": statistics.median(seconds),
    }
    if args.case == "memory":  # side by side: the same loss restored from the last checkpoint
        report["checkpoint_path_s"] = [r["checkpoint"] for r in rounds]
        report["checkpoint_path_median_s"] = statistics.median(report["checkpoint_path_s"])
    json_out.emit(report, indent=1)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    json_out.run(main)
