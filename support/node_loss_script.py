"""The driver scripts a namespace cluster runs (`netns_cluster`): a prelude that joins the cluster
with the toy model at hand, a run that loses a node part-way, and `drive`, which runs one and
reads its RESULT line; and the elastic runs, which lose a node and shrink, then grow back when it
returns. The cluster and recovery tests and `benchmarks/node_loss.py` run them."""

from __future__ import annotations

import json
from pathlib import Path

from netns_cluster import NetnsCluster

SUPPORT = Path(__file__).resolve().parent  # the scripts import the toy model from here

PRELUDE = """
import json, subprocess, tempfile, time
import ray, torch
from torch import nn
from toy_models import MLP7, batch, reference_run
from raypipe import LayerSpec, PlacementError, TrainConfig, Trainer
from raypipe.observe.diagram import Architecture
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
NAMESPACES = json.loads('{namespaces}')  # node ip -> its network namespace
SGD, PLAIN_SGD = {{"name": "sgd", "lr": 0.05}}, lambda params: torch.optim.SGD(params, lr=0.05)
def where(trainer):
    ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
    return {{i["name"]: ips[i["node_id"]] for i in trainer.stage_info()}}
"""

LOSS_RUN = """
def kill_node(ip):  # every process of the node's namespace at once, as a machine losing power
    subprocess.run(f"ip netns pids {{NAMESPACES[ip]}} | xargs -r kill -9", shell=True, check=True, timeout=30)

def run(steps, kill_after, timeout):
    config = TrainConfig(pp=2, devices=["cpu", "mps"], allow_cpu_fallback=True, placement="strict_spread",
                         cpus_per_actor=0.25, optimizer=SGD, checkpoint_dir=tempfile.mkdtemp(dir="{tmp}"),
                         checkpoint_every=2, max_restarts=1, actor_start_timeout=timeout, name="lossy")
    losses, marks = {{}}, {{"log": []}}
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        before = where(t)
        def on_step(metrics):
            losses.setdefault(t.step_count, []).append(metrics["loss"])
            if t.step_count == kill_after and "killed" not in marks:
                marks["lost"] = before["stage1-dp0-tp0"]
                kill_node(marks["lost"])
                marks["killed"] = time.monotonic()
            elif t.restarts and "resumed" not in marks:
                marks["resumed"] = time.monotonic() - marks["killed"]
        try:
            t.fit(lambda k: batch(k), steps, on_step=on_step, log=marks["log"].append)
        except PlacementError as error:
            return {{"error": str(error), "seconds": time.monotonic() - marks["killed"], "lost": marks["lost"],
                     "log": marks["log"]}}
        return {{"losses": losses, "before": before, "after": where(t), "restarts": t.restarts, **marks}}
"""


def drive(cluster: NetnsCluster, template: str, tmp_path: Path, timeout: float = 420) -> dict:
    namespaces = json.dumps({n.ip: n.name for n in cluster.nodes.values()})
    code = template.format(address=cluster.address, namespaces=namespaces, tmp=tmp_path)
    run = cluster.run_python(code, timeout=timeout, env={"PYTHONPATH": str(SUPPORT)})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stdout[-4000:] + run.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


ELASTIC_RUN = """
import json, subprocess, tempfile, time
import ray
from torch import nn
from toy_models import MLP7, batch, reference_run
from raypipe import TrainConfig, Trainer
ray.init(address="{address}", logging_level="ERROR", log_to_driver=False)
NAMESPACES = json.loads('{namespaces}')  # node ip -> its network namespace

def alive():
    return {{n["NodeID"] for n in ray.nodes() if n["Alive"]}}

def run(name, steps, lose, grow=True, elastic=True, **shape):
    config = TrainConfig(**shape, placement="strict_spread", cpus_per_actor=0.25, allow_cpu_fallback=True,
                         optimizer={{"name": "sgd", "lr": 0.05}}, checkpoint_dir=tempfile.mkdtemp(dir="{tmp}"),
                         checkpoint_every=2, max_restarts=2, elastic=elastic, replace_wait=5,
                         actor_start_timeout=60, name=name)
    steps_seen, log, marks = [], [], {{}}
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        ips = {{n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}}
        held = {{i["name"]: ips[i["node_id"]] for i in t.stage_info()}}
        # never the head's node: this driver runs there
        lost = next(held[name] for name in lose if held[name] != "{address}".split(":")[0])
        def on_step(m):
            steps_seen.append([m["step"], m["loss"], m["pp"], m["dp"]])
            if m["step"] == 3 and "killed" not in marks:  # every process of the node at once
                subprocess.run(f"ip netns pids {{NAMESPACES[lost]}} | xargs -r kill -9", shell=True, timeout=30)
                marks["killed"], marks["nodes"] = time.monotonic(), alive()
            elif "killed" in marks and "resumed" not in marks:
                marks["resumed"] = time.monotonic() - marks["killed"]
                marks["topology"] = t.stage_info()[0]["topology"]
                print("RESTART " + lost, flush=True)  # the test starts the node's Ray again
                deadline = time.monotonic() + 120
                while grow and not alive() - marks["nodes"] and time.monotonic() < deadline:
                    time.sleep(0.5)
        def noted(line):  # when the loss was noticed, for benchmarks/node_loss.py
            if "killed" in marks and "noticed" not in marks:
                marks["noticed"] = time.monotonic() - marks["killed"]
            log.append(line)
        t.fit(lambda k: batch(k), steps, on_step=on_step, log=noted)
        return {{"steps": steps_seen, "log": log, "lost": lost, "resumed": marks["resumed"], "pp": t.config.pp,
                 "noticed": marks["noticed"],
                 "dp": t.config.dp, "names": t.names, "restarts": t.restarts, "topology": marks["topology"]}}

"""

ELASTIC = (
    ELASTIC_RUN
    + """
out = {{"reference": reference_run(MLP7, 0, lambda p: __import__("torch").optim.SGD(p, lr=0.05), 8, microbatches=2)[0]}}
out["pp"] = run("elastic-pp", 8, ["stage2-dp0-tp0"], pp=3, devices=["cpu", "mps", "mps"], microbatches=2)
out["dp"] = run("elastic-dp", 8, ["stage1-dp1-tp0", "stage0-dp1-tp0"], pp=2, dp=2, microbatches=2)
# a spare node up: the lost replica is replaced there, and the new actors take the survivor's state
out["spare"] = run("replica-spare", 6, ["stage0-dp1-tp0", "stage0-dp0-tp0"], grow=False, elastic=False, dp=2,
                   microbatches=1)
print("RESULT " + json.dumps(out))
"""
)
