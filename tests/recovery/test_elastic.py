"""Elastic training (issue 38): a run that loses a node with no spare goes on with fewer
pipeline stages or replicas, and grows back to its configured topology once the node returns.

On the namespace cluster (real nodes in network namespaces, real kills of every process of a
node; conftest's `netns_cluster`):
- pp = 3 (a cpu stage, two mps ones) loses an mps node: no node of that kind is left, so it
  goes on at pp = 2 from its last checkpoint; the node restarted, it grows back to pp = 3 at the
  next checkpoint. Every loss, replayed ones included, is one process's.
- pp = 2 x dp = 2 on all four nodes loses one: it goes on at dp = 1 with 2 x the microbatches
  (the same global batch, so the same losses) from the surviving replica's state, replaying no
  step, and grows back to dp = 2.
- dp = 2 on two nodes loses one with a spare node up: the new replica starts there from the
  survivor's state; the failed step runs again, none is replayed.

On the test session's local Ray: each limit stops with an error naming it.
"""

from __future__ import annotations

import json

import pytest

from node_loss_script import ELASTIC, SUPPORT


def check_run(run: dict, reference: list[float], small: tuple[int, int], full: tuple[int, int]) -> None:
    """Steps 1-3 on the full topology; step 3 replayed from step 2's checkpoint on the small one up
    to step 4's checkpoint; then the full one again; every loss one process's."""
    shapes = [(step, (pp, dp)) for step, _, pp, dp in run["steps"]]
    assert shapes == [(1, full), (2, full), (3, full), (3, small), (4, small)] + [(k, full) for k in range(5, 9)], (
        shapes,
        run["log"],
    )
    for step, loss, _, _ in run["steps"]:
        assert loss == pytest.approx(reference[step - 1], rel=1e-5, abs=1e-6), (step, run["log"])
    assert (run["pp"], run["dp"]) == full and run["restarts"] == 1, run
    shrunk = {"pp": small[0], "dp": small[1], "tp": 1, "configured_pp": full[0], "configured_dp": full[1]}
    assert run["topology"] == shrunk, run["topology"]  # stage_info() while shrunk
    log = "\n".join(run["log"])
    assert f"raypipe: lost node {run['lost']} (id " in log, log
    assert f"shrinking from pp={full[0]} x dp={full[1]}" in log and f"to pp={small[0]} x dp={small[1]}" in log, log
    assert f"growing back from pp={small[0]} x dp={small[1]}" in log and "at step 4" in log, log


def check_memory_run(run: dict, reference: list[float], small: tuple[int, int], full: tuple[int, int]) -> None:
    """A loss restored from the surviving replicas: every step once (none replayed), each loss one
    process's; from the failed step (or, when the node died as step 4's checkpoint was written, the
    step after it) on the `small` topology until the node is back, when it grows back to `full` at
    once, from the actors' memory."""
    log = "\n".join(run["log"])
    steps = [step for step, _, _, _ in run["steps"]]
    assert steps == list(range(1, len(steps) + 1)), (steps, log)
    for step, loss, _, _ in run["steps"]:
        assert loss == pytest.approx(reference[step - 1], rel=1e-5, abs=1e-6), (step, log)
    shapes = [(pp, dp) for _, _, pp, dp in run["steps"]]
    shrunk = [k + 1 for k, shape in enumerate(shapes) if shape != full]
    if small != full:
        assert shrunk and shrunk == list(range(shrunk[0], shrunk[-1] + 1)), (shapes, log)
        assert shrunk[0] in (4, 5) and shapes[shrunk[0] - 1] == small, (shapes, log)
        assert f"shrinking from pp={full[0]} x dp={full[1]} " in log, log
        assert f"growing back from pp={small[0]} x dp={small[1]}" in log and "(from memory)" in log, log
    else:
        assert not shrunk, (shapes, log)
    assert "from the surviving replicas" in log and "none is replayed" in log, log
    assert "raypipe: resumed at step 2 from" not in log, log
    assert (run["pp"], run["dp"]) == full and run["restarts"] == 1, run


def test_a_lost_node_shrinks_the_run_and_its_return_grows_it_back(cluster, tmp_path):
    """The three runs of `ELASTIC`: pp = 3 loses a stage (from the checkpoint), pp 2 x dp 2 a
    replica and shrinks, dp = 2 a replica with a spare node up (both from the survivors' memory)."""
    restarted = []

    def on_line(line: str) -> None:
        if line.startswith("RESTART "):
            ip = line.split()[1]
            name = next(n for n, node in cluster.nodes.items() if node.ip == ip)
            cluster.restart_node(name)
            restarted.append(name)

    namespaces = json.dumps({n.ip: n.name for n in cluster.nodes.values()})
    code = ELASTIC.format(address=cluster.address, namespaces=namespaces, tmp=tmp_path)
    stdout, stderr = cluster.run_python_live(code, on_line, timeout=480, env={"PYTHONPATH": str(SUPPORT)})
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-4000:] + stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    print("\n" + "\n".join(out["pp"]["log"] + out["dp"]["log"] + out["spare"]["log"]))
    # pp = 3 -> 2: the lost mps stage's layers split over a cpu and an mps stage (allow_cpu_fallback);
    # no replica holds a copy, so the checkpoint is restored and the steps since replayed
    check_run(out["pp"], out["reference"], (2, 1), (3, 1))
    # pp 2 x dp 2 -> dp 1: the surviving replica takes 4 microbatches (the global batch unchanged)
    # and the state it holds: nothing replayed
    check_memory_run(out["dp"], out["reference"], (2, 1), (2, 2))
    assert "(4 microbatches)" in "\n".join(out["dp"]["log"])
    assert out["dp"]["topology"] == {"pp": 2, "dp": 1, "tp": 1, "configured_pp": 2, "configured_dp": 2}
    # dp = 2 with a spare node: the lost replica starts there from the survivor's state
    check_memory_run(out["spare"], out["reference"], (1, 2), (1, 2))
    for case in ("pp", "dp", "spare"):
        print(f"{case}: node lost after step 3 -> next step completed {out[case]['resumed']:.1f} s later")
    assert len(restarted) == 3


def test_each_elastic_limit_stops_with_an_error_naming_it(ray_session):
    """Limits checked where the cluster is not needed: the shrink's choices (`elastic.smaller`)
    and the error `elastic.place` raises when none is left, on the local Ray (a pp = 2 run whose
    mps stage finds no mps node, as after losing the only one)."""
    from torch import nn

    from raypipe import PlacementError, TrainConfig
    from raypipe.driver.actor_group import ActorGroup
    from raypipe.driver.run import elastic
    from raypipe.models.model import resolve

    from helpers import MLP7

    def group(**fields):
        config = TrainConfig(elastic=True, max_restarts=1, replace_wait=1, **fields)
        model, loss_fn, specs, config = resolve(MLP7, nn.functional.mse_loss, config)
        plan = elastic.first_plan(specs, config, False)[0]
        return ActorGroup(config, specs, plan, loss_fn, "elastic-limits", model)

    reasons = []
    found = elastic.smaller(group(pp=2, dp=2, microbatches=3), {(1, 1)}, reasons)
    assert [(c.pp, c.dp, c.microbatches) for c, _ in found] == [(2, 1, 6), (1, 2, 3)] and not reasons
    assert found[1][1] == [(0, 7)]
    reasons = []
    assert elastic.smaller(group(pp=2, dp=2, min_pp=2, min_dp=2), {(1, 1)}, reasons) == []
    assert "below TrainConfig.min_dp=2" in reasons[0] and "below TrainConfig.min_pp=2" in reasons[1], reasons
    reasons = []
    assert elastic.smaller(group(pp=2, devices=["cuda", "cpu"], gpus_per_actor=0.5), {(0, 0)}, reasons) == []
    assert "layer 0 runs on a cuda stage and would move to a cpu one" in reasons[0], reasons

    lonely = group(pp=2, devices=["cpu", "mps"], min_pp=2)
    with pytest.raises(PlacementError) as caught:
        elastic.place(lonely, {"stage1-dp0-tp0": "f" * 56}, {"f" * 56}, print)
    assert "cannot shrink: pp=1 would go below TrainConfig.min_pp=2" in str(caught.value), caught.value
    assert (lonely.config.pp, lonely.plan, lonely.actors) == (2, [(0, 3), (3, 7)], []), lonely.plan


def test_a_restore_from_memory_needs_every_layer_of_each_rank_from_survivors():
    """What decides between the survivors' memory and the checkpoint (`raypipe.driver.run.replicas`),
    without Ray: the config allows it, and the survivors together hold every layer of each tp rank."""
    from raypipe import TrainConfig
    from raypipe.core.protocol import HeldState
    from raypipe.driver.run import replicas

    assert replicas.why_not(TrainConfig(dp=2)) is None
    assert "ZeRO-1 share" in replicas.why_not(TrainConfig(dp=2, zero=1))
    assert "restore_from_replicas is off" in replicas.why_not(TrainConfig(dp=2, restore_from_replicas=False))
    assert "dp = 1" in replicas.why_not(TrainConfig(pp=2))

    def held(name, layers, tp_rank=0):
        return HeldState(name, tp_rank, 0, tuple(layers), 3, 0)

    # pp 2 x dp 2 lost stage1-dp0 and stage0-dp1: each stage survives in one replica
    survivors = [held("stage0-dp0-tp0", range(3)), held("stage1-dp1-tp0", range(3, 7))]
    config = TrainConfig(pp=2, dp=2)
    assert replicas.uncovered(survivors, config, 7) == ""
    assert replicas.uncovered(survivors[:1], config, 7) == "layers 3-6 were held by lost actors only"
    tp2 = TrainConfig(pp=2, dp=2, tp=2)
    gaps = replicas.uncovered(survivors + [held("stage0-dp1-tp1", range(3), 1)], tp2, 7)
    assert gaps == "layers 3-6 of tp rank 1 were held by lost actors only", gaps
    # the new stage1-dp0 loads from the survivor of its stage; a single stage (pp shrunk to 1) from both
    assert [
        h.name for h, _ in replicas.donors([(h, None) for h in survivors], "stage1-dp0-tp0", 0, 0, [3, 4, 5, 6])
    ] == ["stage1-dp1-tp0"]
    both = replicas.donors([(h, None) for h in survivors], "stage0-dp0-tp0", 0, 0, list(range(7)))
    assert [h.name for h, _ in both] == ["stage0-dp0-tp0", "stage1-dp1-tp0"]
    assert replicas.compact([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_a_lost_tensor_parallel_rank_takes_its_shard_from_the_other_replica(ray_session):
    """tp = 2 x dp = 2 with AdamW: the actor of replica 1's tp rank 1 is killed between steps 2 and
    3; the new one loads replica 0's tp rank 1 shard (and its Adam moments) from memory, step 3
    runs again, nothing is replayed, and every loss is one process's."""
    import ray
    import torch

    from raypipe import TrainConfig, Trainer
    from raypipe.models import gpt

    from helpers import lm_tokens, reference_run

    model = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)

    def data(k):
        return lm_tokens(model, k, 8, seed=500)

    adamw = {"name": "adamw", "lr": 0.01}
    config = TrainConfig(dp=2, tp=2, microbatches=1, seed=3, optimizer=adamw, max_restarts=1, cpus_per_actor=0.2)
    log = []
    with Trainer(gpt.layers(model), gpt.loss_fn, config) as t:
        victim = t.group.actors[t.names.index("stage0-dp1-tp1")]

        def on_step(metrics):
            if metrics["step"] == 2 and t.restarts == 0:
                ray.kill(victim)

        history = t.fit(data, 5, on_step=on_step, log=log.append)
        assert t.restarts == 1
    text = "\n".join(log)
    assert [m["step"] for m in history] == [1, 2, 3, 4, 5], text
    assert "took the state of step 2 from" in text and "stage0-dp0-tp1" in text, text
    assert "resumed at step 2 from the surviving replicas" in text, text

    def plain_adamw(params):
        return torch.optim.AdamW(params, lr=0.01)

    reference = reference_run(gpt.layers(model), 3, plain_adamw, 5, microbatches=2, loss_fn=gpt.loss_fn, data=data)
    assert [m["loss"] for m in history] == pytest.approx(reference[0], rel=1e-5, abs=1e-6), text
