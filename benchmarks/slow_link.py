"""A pipeline across a slow link (issue 36): pp = 2, one stage per node of a real Ray cluster in
network namespaces on this machine (`support/netns_cluster.py`; needs root, `ip netns` and `tc`),
1 CPU each, the second node's link limited with `tc tbf` in both directions
(`NetnsCluster.limit_link`), as a home Ethernet or Wi-Fi link between a GPU box and a Mac.

The model: an MLP of 16 features in and out (so the driver's feed, which crosses the link to
whichever stage is far, is small: 256 KiB of inputs or targets per step, counted in the wire time)
whose boundary is 512 rows x 1024 fp32 = 2 MiB per microbatch, 8 microbatches per step, MSE loss.
Per variant (1F1B fp32 and bf16, GPipe fp32, ZB-H1 fp32; 1F1B and ZB-H1 with one extra warm-up
forward, `TrainConfig.extra_warmup`; and 1F1B with it at 16 microbatches of half the rows), one
trainer takes `--steps` timed steps (after one untimed) at each link rate, and the report gives per
rate: the median step, the bytes the stages sent per step (`sent_bytes`), the wire time of the busier
direction (the driver's feed included), and the step over the compute-only step (unlimited link), over
compute + wire (no overlap) and over max(compute, wire) (perfect overlap; issue 36's target is
<= 1.1 for 1F1B-class schedules at 1 Gbit/s and 200 Mbit/s). The `planned` variants leave the
split, schedule, microbatches and warm-up to the planner (`schedule="auto"`, `partition="profile"`),
a trainer per rate since the plan depends on the link: `planned` with the links measured as the
stages start, `planned-blind` without (`probe_links=False`); each row says what was chosen.
`default` sets nothing but the split: what a user who does not tune gets (1F1B with, since issue 76,
one extra forward where the stages are on different nodes); the named 1F1B and ZB-H1 variants set
`extra_warmup=0` so they stay the plain schedules.

The driver runs on the head node's host; between rates it asks this process (in the machine's own
namespace, where the link's qdiscs are set) to change the limit. A fixed-split trainer starts at the
first rate, so its links are measured at that rate (and its log's word after the first timed step,
`raypipe.driver.links.advice`, is about it).

    sudo .venv/bin/python benchmarks/slow_link.py --steps 3 > slow_link.json      # ~12 minutes
    sudo .venv/bin/python benchmarks/slow_link.py --rates 0 50 --steps 2 --variants 1f1b-fp32  # quick
    sudo .venv/bin/python benchmarks/slow_link.py --steps 3 --variants 1f1b-fp32-e1 planned planned-blind  # ~8 min
    sudo .venv/bin/python benchmarks/slow_link.py --steps 3 --variants default 1f1b-fp32   # ~5 min: the default
    sudo .venv/bin/python benchmarks/slow_link.py --rates 200 50 0 --steps 3 --variants default default-fp32
"""

from __future__ import annotations

import argparse
import json
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent.parent / "support"  # modules shared with the tests
sys.path.insert(0, str(SUPPORT))

import json_out  # noqa: E402

from netns_cluster import NetnsCluster, available  # noqa: E402

VARIANTS = {
    # nothing set: what a user who does not tune gets (since issue 76, extra_warmup 1 across nodes, and
    # boundary_dtype "auto": bf16 once a step shows the link bounding it); and the same with fp32 kept
    "default": {},
    "default-fp32": {"boundary_dtype": "fp32"},
    "default-e2": {"extra_warmup": 2},  # the default with two more forwards in flight
    "1f1b-fp32": {"schedule": "1f1b", "boundary_dtype": "fp32", "extra_warmup": 0},
    "1f1b-bf16": {"schedule": "1f1b", "boundary_dtype": "bf16", "extra_warmup": 0},
    "gpipe-fp32": {"schedule": "gpipe", "boundary_dtype": "fp32"},
    "zb-h1-fp32": {"schedule": "zb-h1", "boundary_dtype": "fp32", "extra_warmup": 0},
    "1f1b-fp32-e1": {"schedule": "1f1b", "boundary_dtype": "fp32", "extra_warmup": 1},
    "1f1b-fp32-m16-e1": {"schedule": "1f1b", "boundary_dtype": "fp32", "extra_warmup": 1, "microbatches": 16},
    "zb-h1-fp32-e1": {"schedule": "zb-h1", "boundary_dtype": "fp32", "extra_warmup": 1},
    # the planner's pick: schedule, microbatches, warm-up and split chosen from the profiled layers,
    # with the links measured at start (as a run does by default), and without (link-blind)
    "planned": {"schedule": "auto", "partition": "profile", "planned": True},
    "planned-blind": {"schedule": "auto", "partition": "profile", "planned": True, "probe_links": False},
    # compressed boundaries (8 bits and a scale per row, both ways), by hand and planned
    "1f1b-fp8-e1": {
        "schedule": "1f1b",
        "compress_activations": "fp8-row",
        "compress_gradients": "fp8-row",
        "extra_warmup": 1,
    },
    "planned-fp8": {
        "schedule": "auto",
        "partition": "profile",
        "planned": True,
        "compress_activations": "fp8-row",
        "compress_gradients": "fp8-row",
    },
}

DRIVER = """
import json, sys, time
import ray, torch
from torch import nn
from raypipe import LayerSpec, TrainConfig, Trainer
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
ROWS, WIDTH, INNER, FEED, MICRO = 512, 1024, 512, 16, 8
BLOCK = [LayerSpec(nn.Linear, WIDTH, INNER), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, INNER, WIDTH), LayerSpec(nn.Tanh)]
FIRST = [LayerSpec(nn.Linear, FEED, WIDTH), LayerSpec(nn.Tanh)] + BLOCK
SECOND = BLOCK + [LayerSpec(nn.Linear, WIDTH, FEED)]
torch.manual_seed(0)
x, y = torch.randn(ROWS * MICRO, FEED), torch.randn(ROWS * MICRO, FEED)
here = ray.get_runtime_context().get_node_id()

def limit(mbit):  # the benchmark's process sets the link, then answers
    print("LIMIT " + json.dumps(mbit), flush=True)
    assert sys.stdin.readline().strip() == "ok"

def measure(trainer, name, mbit):
    nodes = [i["node_id"] for i in trainer.stage_info()]
    assert len(set(nodes)) == 2 and here in nodes, "the stages share a node, or neither is on the driver's"
    far = nodes.index(next(n for n in nodes if n != here))
    feed = (x if far == 0 else y).numel() * 4  # the driver's bytes to the far stage, each step
    for _ in range(2):  # untimed: the first steps after a start or a reconfiguration (a narrowed boundary)
        trainer.step(x, y)
    times = []
    for _ in range({steps}):
        started = time.perf_counter()
        metrics = trainer.step(x, y)
        times.append(time.perf_counter() - started)
    sent = [s["sent_bytes"] for s in metrics["stages"]]
    out = sent[1 - far] + feed  # towards the far node: the near stage's sends and the driver's feed
    c = trainer.config
    went = trainer.timeline().breakdown  # the last step: busiest actor's actions, idle, messages
    first = min(e[2] for actor in trainer.state.last_events for e in actor)
    events = [[[e[0], e[1], round(1e3 * (e[2] - first), 1), round(1e3 * (e[3] - first), 1)] for e in actor]
              for actor in trainer.state.last_events]
    print("RESULT " + json.dumps({{"variant": name, "mbit": mbit, "step_s": times, "sent_bytes": sent,
                                   "breakdown": str(went), "events_ms": events,
                                   "wire_bytes": max(out, sent[far]), "plan": trainer.plan, "schedule": c.schedule,
                                   "microbatches": c.microbatches, "extra_warmup": c.extra_warmup,
                                   "boundary_dtype": c.boundary_dtype}}), flush=True)

for name, settings in json.loads('{variants}').items():
    settings = {{"microbatches": MICRO, **settings}}
    planned = settings.pop("planned", False)  # the planner splits and schedules: a trainer per link rate
    split = {{}} if planned else {{"shard_plan": [[0, 6], [6, 11]]}}
    config = TrainConfig(pp=2, placement="strict_spread", cpus_per_actor=1, threads_per_actor=1, step_timeout=600,
                         optimizer={{"name": "sgd", "lr": 1e-3}}, **split, **settings)
    make = lambda: Trainer(FIRST + SECOND, nn.functional.mse_loss, config, sample=(x, y) if planned else None,
                           log=lambda line: print("LOG " + json.dumps(line), flush=True))
    if planned:
        for mbit in json.loads('{rates}'):
            limit(mbit)
            with make() as trainer:
                measure(trainer, name, mbit)
    else:
        limit(json.loads('{rates}')[0])  # the links are measured at the first rate, as the trainer starts
        with make() as trainer:
            for mbit in json.loads('{rates}'):
                limit(mbit)
                measure(trainer, name, mbit)
limit(None)
"""


def drive(cluster: NetnsCluster, far: str, code: str, timeout: float) -> list[dict]:
    """Runs the driver on the head's host, setting `far`'s link whenever it asks; its results."""
    head = next(iter(cluster.nodes.values()))
    proc = subprocess.Popen(
        ["ip", "netns", "exec", head.name, sys.executable, "-c", code],
        env={**cluster.env, "PYTHONPATH": str(SUPPORT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()  # read by a thread: several lines may arrive in one read
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")], daemon=True).start()
    results, deadline = [], time.monotonic() + timeout
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the driver did not finish within {timeout} s") from None
            if not line:
                break
            if line.startswith("LIMIT "):
                mbit = json.loads(line[len("LIMIT ") :])
                cluster.limit_link(far, mbit or None)
                proc.stdin.write("ok\n")
                proc.stdin.flush()
            elif line.startswith("LOG "):
                print(json.loads(line[len("LOG ") :]), file=sys.stderr, flush=True)
            elif line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT ") :]))
                print(line.strip(), file=sys.stderr, flush=True)
        if proc.wait(timeout=60) != 0:
            raise RuntimeError(f"the driver exited with {proc.returncode}")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return results


def report(results: list[dict]) -> dict:
    """Per variant and rate: the median step and how it compares with compute and wire time."""
    out: dict[str, dict] = {}
    compute = {r["variant"]: statistics.median(r["step_s"]) for r in results if not r["mbit"]}
    for r in results:
        step = statistics.median(r["step_s"])
        row = {"median_step_s": step, "step_s": r["step_s"], "sent_bytes_per_stage": r["sent_bytes"]}
        kept = ("plan", "schedule", "microbatches", "extra_warmup", "boundary_dtype", "breakdown", "events_ms")
        row.update({k: r[k] for k in kept if k in r})
        # with model chunks (zb-v, interleaved) sent_bytes count the messages between an actor's own
        # chunks too, which cross no link: no wire time is derived for them
        if r["mbit"] and r["schedule"] not in ("zb-v", "interleaved-1f1b"):
            wire = r["wire_bytes"] * 8 / (r["mbit"] * 1e6)  # the busier direction, the driver's feed included
            row["wire_s"] = wire
            if r["variant"] in compute:
                c = compute[r["variant"]]
                row["over_compute"] = step / c
                row["over_compute_plus_wire"] = step / (c + wire)
                row["over_max_compute_wire"] = step / max(c, wire)
        out.setdefault(r["variant"], {})[str(r["mbit"] or "unlimited")] = row
    # the default against itself with fp32 kept, side by side: its speed-up, and its step over
    # max(compute, the wire time of the fp32 bytes) (issue 76's measure, taken before "auto")
    for rate, row in out.get("default", {}).items():
        kept = out.get("default-fp32", {}).get(rate)
        if kept is not None and "wire_s" in kept and "over_compute" in row:
            row["speedup_over_fp32"] = kept["median_step_s"] / row["median_step_s"]
            c = row["median_step_s"] / row["over_compute"]
            row["over_max_compute_fp32_wire"] = row["median_step_s"] / max(c, kept["wire_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[0, 1000, 200, 50], help="Mbit/s; 0: unlimited")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    reason = available() or (None if shutil.which("tc") else "no `tc` command")
    if reason:
        sys.exit(f"cannot run: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that a killed run still removes its cluster
    work = Path(tempfile.mkdtemp(prefix="slow-link-"))
    cluster = NetnsCluster(work)
    try:
        for name in ("head", "far"):
            cluster.start_node(name, num_cpus=1)
            cluster.wait_nodes()
        code = DRIVER.format(
            address=cluster.address,
            variants=json.dumps({v: VARIANTS[v] for v in args.variants}),
            rates=json.dumps(args.rates),
            steps=args.steps,
        )
        results = drive(cluster, cluster.nodes["far"].name, code, timeout=3600)
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    json_out.emit(
        {
            "benchmark": "slow_link",
            "setup": "pp 2, one stage per namespace node, 1 CPU each, 8 microbatches of 2 MiB boundaries",
            "steps": args.steps,
            "variants": {v: VARIANTS[v] for v in args.variants},
            "results": report(results),
        },
        indent=1,
    )


if __name__ == "__main__":
    json_out.run(main)
