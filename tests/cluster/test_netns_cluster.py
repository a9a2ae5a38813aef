"""A real Ray cluster on this machine (issue 22): four `ray start` nodes, each in a network
namespace of its own with its own /dev/shm (`netns_cluster`), two of them advertising mps
through the fake-accelerator override, as cluster.yaml's start commands would on Macs.

- Pipelines span the nodes (pp = 3, and pp = 2 x dp = 2), every boundary between nodes goes
  over gloo through the veth network, and the losses are plain PyTorch's in one process; so do
  NCCL's in-order device streams (`device_links="nccl"`, over gloo on these CPU stages).
- A whole node is lost mid-`fit` (every process in its namespace SIGKILLed): training goes on
  from the last checkpoint on the spare node of the same kind with the uninterrupted losses;
  once no spare is left, the trainer fails within `actor_start_timeout` naming the lost node
  and the stage it held.
- A host's link limited with `tc tbf` (`NetnsCluster.limit_link`, issue 36's slow-link condition)
  carries its rate each way, and its full speed once lifted; a run across such links measures
  them when it starts and a profiled split moves to where the boundary is small; a split left at
  a wide boundary, which the link bounds, has its boundaries narrowed to bf16 (`boundary_dtype`
  "auto").
"""

from __future__ import annotations

import re

import pytest

from netns_cluster import NetnsCluster, available
from node_loss_script import LOSS_RUN, PRELUDE, drive

REASON = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


SPANNING = (
    PRELUDE
    + """
out = {{}}
for pp, dp, device_links in ((3, 1, "auto"), (2, 2, "auto"), (3, 1, "nccl")):
    config = TrainConfig(pp=pp, dp=dp, microbatches=2, placement="strict_spread", cpus_per_actor=0.25,
                         optimizer=SGD, actor_start_timeout=90, name=f"span{{pp}}x{{dp}}", device_links=device_links)
    with Trainer(MLP7, nn.functional.mse_loss, config) as t:
        losses = [t.step(*batch(k))["loss"] for k in range(3)]
        info = t.stage_info()
        out[f"{{pp}}x{{dp}}" + ("-ordered" if device_links == "nccl" else "")] = {{"losses": losses, "where": where(t),
                                 "extra_warmup": t.config.extra_warmup,
                                 "links": {{i["name"]: i["links"] for i in info}},
                                 "diagram": Architecture.from_trainer(t, torch.zeros(8, 6)).to_mermaid()}}
out["reference"] = reference_run(MLP7, 0, PLAIN_SGD, 3, microbatches=2)[0]
print("RESULT " + json.dumps(out))
"""
)


NODE_LOSS = (
    PRELUDE
    + LOSS_RUN
    + """
out = {{"spare": run(8, 5, 90), "reference": reference_run(MLP7, 0, PLAIN_SGD, 8)[0]}}
out["no_spare"] = run(4, 2, 20)
print("RESULT " + json.dumps(out))
"""
)


def test_pipelines_span_real_nodes_over_gloo_with_one_process_losses(cluster, tmp_path):
    out = drive(cluster, SPANNING, tmp_path)
    ips = {n.ip for n in cluster.nodes.values()}
    for shape, actors in (("3x1", 3), ("2x2", 4)):
        run = out[shape]
        assert len(set(run["where"].values())) == actors and set(run["where"].values()) <= ips, run["where"]
        # every pipeline link joins two nodes, so none can be shared memory
        assert all(how == "gloo" for links in run["links"].values() for how in links.values()), run["links"]
        assert sum(len(links) for links in run["links"].values()) == 2 * (actors - 1 if shape == "3x1" else 2)
        # each link between nodes drawn with its transport and the rate measured when the run started
        labels = re.findall(r' float32 over gloo at [\d,]+ Mbit/s" -->', run["diagram"])
        assert len(labels) == (2 if shape == "3x1" else 1), run["diagram"]
        assert run["losses"] == pytest.approx(out["reference"], rel=1e-5, abs=1e-6), shape
        assert run["extra_warmup"] == 1, shape  # left unset, stages across nodes run one more forward ahead
    # NCCL's in-order streams (here over gloo: CPU stages) between nodes, as between GPU hosts
    run = out["3x1-ordered"]
    assert len(set(run["where"].values())) == 3
    assert all(how == "gloo (ordered)" for links in run["links"].values() for how in links.values()), run["links"]
    assert run["losses"] == pytest.approx(out["reference"], rel=1e-5, abs=1e-6)


LINKED = (
    PRELUDE
    + """
WIDE = [LayerSpec(nn.Linear, 16, 512), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 512, 512), LayerSpec(nn.Tanh)]
MODEL = WIDE + [LayerSpec(nn.Linear, 512, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 16)]
data = lambda k: batch(k, 256, 16, 16)
config = TrainConfig(pp=2, microbatches=4, partition="profile", devices=["cpu", "mps"], allow_cpu_fallback=True,
                     placement="strict_spread", cpus_per_actor=0.25, optimizer=SGD, actor_start_timeout=90,
                     name="linked")
lines = []
with Trainer(MODEL, nn.functional.mse_loss, config, sample=data(0), log=lines.append) as t:
    losses = [t.step(*data(k))["loss"] for k in range(3)]
    again = [link.to_dict() for link in t.links()]
    out = {{"plan": t.plan, "lines": lines, "links": again, "losses": losses, "where": where(t),
           "rates": {{i["name"]: i["link_rates"] for i in t.stage_info()}},
           "report": t.plan_report.to_dict()["links"],
           "diagram": Architecture.from_trainer(t, torch.zeros(64, 16)).to_mermaid()}}
# the split at the 512-wide boundary, left as it is, on 4 times the rows: the link bounds its steps
# (2 MiB each way, 0.9 s), so "auto" narrows it
big = lambda k: batch(k, 1024, 16, 16)
wide = TrainConfig(pp=2, microbatches=4, shard_plan=[[0, 4], [4, 7]], devices=["cpu", "mps"],
                   allow_cpu_fallback=True, placement="strict_spread", cpus_per_actor=0.25, optimizer=SGD,
                   actor_start_timeout=90, name="linked-wide")
lines = []
with Trainer(MODEL, nn.functional.mse_loss, wide, log=lines.append) as t:
    steps = t.fit(big, 4)  # the next step queued at the actors while one is booked: it runs as sent
    out["wide"] = {{"lines": lines, "losses": [m["loss"] for m in steps], "dtype": t.config.boundary_dtype,
                   "sent": [[s["sent_bytes"] for s in m["stages"]] for m in steps]}}
out["reference"] = reference_run(MODEL, 0, PLAIN_SGD, 3, microbatches=4, data=data)[0]
out["wide"]["reference"] = reference_run(MODEL, 0, PLAIN_SGD, 4, microbatches=4, data=big)[0]
print("RESULT " + json.dumps(out))
"""
)


def test_links_are_measured_and_a_profiled_split_moves_to_a_narrow_boundary(cluster, tmp_path):
    """Issue 36: the mps nodes' links limited to 20 Mbit/s, a pp = 2 run across them (a cpu stage and
    an mps one, strict_spread) measures its link each way at its rate when it starts, shows it in
    `stage_info()`, the plan report and the diagram, and plans again for it: the link-blind split
    cuts the 512-wide activations (128 KiB per microbatch, 52 ms on the link), the split planned
    for the link the 8-wide ones, and the restarted stages train exactly as one process does."""
    limited = [cluster.nodes["mps-a"].name, cluster.nodes["mps-b"].name]
    try:
        for ns in limited:
            cluster.limit_link(ns, 20)
        out = drive(cluster, LINKED, tmp_path)
    finally:
        for ns in limited:
            cluster.limit_link(ns, None)
    assert len(set(out["where"].values())) == 2, out["where"]
    print("\n" + "\n".join(out["lines"]))
    for link in out["links"]:
        assert link["transport"] == "gloo" and 12 < link["mbit_per_s"] < 22, out["links"]
        assert 0 < link["latency_s"] < 0.05, out["links"]
    log = "\n".join(out["lines"])
    assert "links measured between stages:" in log and "starting the stages again with the new split" in log, log
    assert "raypipe: stages on different nodes (stage 0 -> stage 1 over gloo: " in log and "extra_warmup=1" in log
    blind = log.split("the link-blind plan (1f1b, m=4, ")[1].split(")]")[0]
    assert blind.startswith("[(0, 2)") or blind.startswith("[(0, 3)") or blind.startswith("[(0, 4)"), log
    assert out["plan"][0][1] in (5, 6), (out["plan"], log)  # after an 8-wide layer
    assert out["losses"] == pytest.approx(out["reference"], rel=1e-5, abs=1e-6)
    assert [r["sender"] for r in out["report"]] == [0, 1] and all(r["share_of_step"] > 0 for r in out["report"])
    rates = [rate for per_actor in out["rates"].values() for rate in per_actor.values()]
    assert len(rates) == 2 and all(12 < r["mbit_per_s"] < 22 for r in rates), out["rates"]
    assert " float32 over gloo at 1" in out["diagram"] or " float32 over gloo at 2" in out["diagram"], out["diagram"]
    # issue 76: the same link under the split at the wide boundary bounds the step; boundary_dtype
    # left "auto" sends bf16 from the next step on (said in the log), half the bytes each way, and
    # the steps before it are exactly one process's (the planned run above, never bound, all three)
    wide = out["wide"]
    said = "\n".join(wide["lines"])
    print("\n" + said)
    narrowed = re.search(r"the link bounds the step, so from step (\d) on the boundaries cross in bf16", said)
    assert narrowed is not None and wide["dtype"] == "bf16", said
    # 0-based: the first step in bf16, after the step that decided (the warm-up or the first timed
    # one) and the one fit had queued behind it
    first = int(narrowed.group(1)) - 1
    assert first in (2, 3) and "boundary_dtype='fp32' keeps them exact" in said, said
    assert all(sent == wide["sent"][0] for sent in wide["sent"][:first]), wide["sent"]
    assert all(sent == [b // 2 for b in wide["sent"][0]] for sent in wide["sent"][first:]), wide["sent"]
    assert wide["losses"][:first] == pytest.approx(wide["reference"][:first], rel=1e-5, abs=1e-6)
    assert wide["losses"] == pytest.approx(wide["reference"], rel=1e-2)  # bf16's rounding at the boundary only


def test_a_lost_node_fails_over_to_a_spare_and_without_one_the_error_names_it(cluster, tmp_path):
    out = drive(cluster, NODE_LOSS, tmp_path)
    spare, mps_nodes = out["spare"], {cluster.nodes["mps-a"].ip, cluster.nodes["mps-b"].ip}
    assert spare["restarts"] == 1 and spare["lost"] in mps_nodes, spare
    assert spare["after"]["stage1-dp0-tp0"] == (mps_nodes - {spare["lost"]}).pop()  # the spare took it
    # found lost at once (its raylet refuses connections), before Ray's health checks mark it dead
    assert any(
        line.startswith(f"raypipe: lost node {spare['lost']} (id ") and "held stage1-dp0-tp0" in line
        for line in spare["log"]
    ), spare["log"]
    # the run resumed from its last checkpoint and replayed what followed: every step's losses,
    # first run and replay alike, are the uninterrupted ones
    steps = {int(k): v for k, v in spare["losses"].items()}
    assert sorted(steps) == list(range(1, 9)) and max(len(v) for v in steps.values()) == 2, steps
    for k, values in steps.items():
        assert values == pytest.approx([out["reference"][k - 1]] * len(values), rel=1e-5, abs=1e-6), k
    print(f"\nnode lost after step 5: the next step completed {spare['resumed']:.1f} s after the kill")

    failed = out["no_spare"]
    assert failed["lost"] == (mps_nodes - {spare["lost"]}).pop()
    assert f"node {failed['lost']}" in failed["error"] and "held stage1-dp0-tp0" in failed["error"], failed
    assert "stage1-dp0-tp0" in failed["error"] and "mps" in failed["error"], failed
    print(f"no spare left: PlacementError {failed['seconds']:.1f} s after the kill")


LINK_PEER = """
import socket, sys
n = int(sys.argv[1])
with socket.create_server((sys.argv[2], 5599)) as server:
    print("ready", flush=True)
    server.settimeout(60)
    for _ in range(2):  # limited, then lifted
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            got = 0
            while got < n:
                got += len(conn.recv(1 << 16))
            conn.sendall(b"k")  # all of the upload arrived
            conn.recv(1)  # the download may start
            conn.sendall(bytes(n))
"""


def test_a_limited_link_carries_its_rate_each_way_and_is_lifted(tmp_path):
    """`NetnsCluster.limit_link`, the slow-link condition of tests and `benchmarks/slow_link.py`:
    1 MB each way over a host's link limited to 16 Mbit/s takes its wire time (0.5 s) in both
    directions, and a small fraction of it once the limit is lifted."""
    import socket
    import subprocess
    import sys
    import time

    n = 1_000_000
    net = NetnsCluster(tmp_path)
    try:
        ns, ip = net.add_host("home")
        peer = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", LINK_PEER, str(n), ip],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert peer.stdout.readline().strip() == "ready"

            def both_ways() -> tuple[float, float]:
                with socket.create_connection((ip, 5599), timeout=60) as conn:
                    started = time.perf_counter()
                    conn.sendall(bytes(n))
                    assert conn.recv(1) == b"k"
                    up = time.perf_counter() - started
                    conn.sendall(b"g")
                    started, got = time.perf_counter(), 0
                    while got < n:
                        got += len(conn.recv(1 << 16))
                    return up, time.perf_counter() - started

            net.limit_link(ns, 16)
            limited = both_ways()
            net.limit_link(ns, None)
            lifted = both_ways()
            peer.wait(timeout=30)
        finally:
            peer.kill()
            peer.wait(timeout=30)
        wire = n * 8 / 16e6
        assert all(0.8 * wire < t < 4 * wire for t in limited), limited
        assert all(t < 0.3 * wire for t in lifted), lifted
    finally:
        net.close()
    assert net.leftovers() == [], net.leftovers()
