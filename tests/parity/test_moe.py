"""Mixture of Experts and expert parallelism: the router's rules in one process, then dp x ep x tp x pp
at parity with the one-process MoE model (losses with the aux loss, first-step gradients, weights
after 3 SGD-momentum steps, and the very same tokens dropped), checkpoints across ep, and what a
run reports (TensorBoard, timeline, diagram)."""

import math

import pytest
import torch
from torch import nn

from raypipe import ConfigError, LayerSpec, TrainConfig, Trainer, build_layers
from raypipe.models import gpt
from raypipe.nn.moe import MoE, moe_layers
from raypipe.observe.diagram import Architecture

from helpers import assert_close_dicts, check_sgd_parity, lm_tokens, reference_run, tensorboard_run

SEED = 3
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
BASE = dict(vocab_size=32, block_size=8, n_head=2, n_embd=16, n_layer=4, num_experts=4)
# every routing rule in one model: top-1 and top-2, with capacity drops and dropless, a z-loss
BLOCKS = [
    gpt.GPTConfig(**BASE, top_k=1, capacity_factor=1.0),
    gpt.GPTConfig(**BASE, top_k=2, capacity_factor=None, z_loss_coef=1e-3),
    gpt.GPTConfig(**BASE, top_k=2, capacity_factor=0.75),
    gpt.GPTConfig(**BASE, top_k=1, capacity_factor=None),
]
CFG = BLOCKS[0]
LAYERS = [LayerSpec(gpt.Embedding, CFG)] + [LayerSpec(gpt.MoEBlock, c) for c in BLOCKS] + [LayerSpec(gpt.Head, CFG)]
M = 2  # microbatches per replica


def tokens(k: int, size: int = 8):
    return lm_tokens(CFG, k, size, seed=500)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# ----- the layer in one process ----------------------------------------------------------


def test_capacity_keeps_first_choices_first_and_counts_drops():
    torch.manual_seed(0)
    moe = MoE(8, num_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(10, 8)
    y, aux = moe(x)
    capacity = math.ceil(0.5 * 10 * 2 / 4)
    probs = moe.router(x).softmax(-1)
    chosen = probs.topk(2, dim=-1).indices
    # by hand: first choices in token order, then second choices, each expert up to capacity
    taken, kept = [0] * 4, []
    for slot in range(2):
        for t in range(10):
            e = int(chosen[t, slot])
            kept.append(taken[e] < capacity)
            taken[e] += 1
    assert moe.dropped == kept.count(False) > 0
    assert moe.routed.tolist() == [int((chosen == e).sum()) for e in range(4)]
    # the output is the gate-weighted sum of the kept experts' outputs only
    gates = probs.topk(2, dim=-1).values
    gates = gates / gates.sum(-1, keepdim=True)
    expected = torch.zeros_like(x)
    for i, (slot, t) in enumerate((s, t) for s in range(2) for t in range(10)):
        if kept[i]:
            expected[t] += gates[t, slot] * moe.experts[str(int(chosen[t, slot]))](x[t : t + 1])[0]
    torch.testing.assert_close(y, expected)
    # Switch's load-balancing loss: E * sum_e (share of assignments to e) * (mean gate probability of e)
    share = torch.tensor([float((chosen == e).sum()) / 20 for e in range(4)])
    torch.testing.assert_close(aux, 0.01 * 4 * (share * probs.mean(0)).sum())


def test_dropless_top1_uses_the_raw_probability_and_z_loss_adds():
    torch.manual_seed(1)
    moe = MoE(8, num_experts=4, top_k=1, z_loss_coef=0.1, aux_loss_coef=0.0)
    x = torch.randn(6, 8)
    y, aux = moe(x)
    logits = moe.router(x)
    p, e = logits.softmax(-1).max(-1)
    expected = torch.stack([p[t] * moe.experts[str(int(e[t]))](x[t : t + 1])[0] for t in range(6)])
    torch.testing.assert_close(y, expected)
    assert moe.dropped == 0
    torch.testing.assert_close(aux, 0.1 * torch.logsumexp(logits, -1).pow(2).mean())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=-1), "num_experts=-1"),
        (dict(num_experts=4, top_k=3), "top_k=3"),
        (dict(num_experts=4, capacity_factor=0), "capacity_factor=0"),
        (dict(num_experts=4, aux_loss_coef=-1), "aux_loss_coef=-1"),
    ],
)
def test_moe_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        gpt.GPTConfig(**{**BASE, **kwargs})


def test_ep_must_divide_dp_and_the_experts_and_needs_a_moe(ray_session):
    with pytest.raises(ConfigError, match=r"TrainConfig.ep=2.*divides dp"):
        TrainConfig(dp=3, ep=2)
    with pytest.raises(ConfigError, match=r"engine='p2p'"):
        TrainConfig(dp=2, ep=2, engine="refs")
    with pytest.raises(ConfigError, match=r"4 experts.*3 ranks"):
        Trainer(LAYERS, gpt.loss_fn, TrainConfig(dp=3, ep=3))
    dense = gpt.layers(gpt.GPTConfig(**{**BASE, "num_experts": 0}))
    with pytest.raises(ConfigError, match=r"no layer holds a MoE"):
        Trainer(dense, gpt.loss_fn, TrainConfig(dp=2, ep=2))


# ----- dp x ep x tp x pp at parity ----------------------------------------------------------


@pytest.fixture(scope="module")
def reference():
    """Losses, first-step gradients and weights after 3 steps of the MoE model in one process,
    each replica's microbatch its own forward (routing and capacity are per forward call)."""
    return {
        dp: reference_run(LAYERS, SEED, sgd, steps=3, microbatches=M * dp, loss_fn=gpt.loss_fn, data=tokens)
        for dp in (2, 4)
    }


def reference_routing(initial, dp):
    """Per MoE layer ("<layer>.mlp"), (assignments per expert, drops) of the one-process model at
    `initial` weights over replica 0's microbatches of a batch cut for `dp` replicas."""
    model = nn.Sequential(*build_layers(LAYERS, SEED))
    model.load_state_dict(initial)
    for x in tokens(0)[0].chunk(M * dp)[:M]:
        model(x)
    return {name: (m.routed.tolist(), m.dropped) for name, m in moe_layers(model)}


# pp, dp, ep, tp: the three, and dp=4 with ep=2, where each expert has two holders
TOPOLOGIES = [(1, 2, 2, 1), (2, 2, 2, 1), (2, 2, 2, 2), (1, 4, 2, 1)]


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda p: "pp{}-dp{}-ep{}-tp{}".format(*p))
def trainer(request, ray_session):
    pp, dp, ep, tp = request.param
    t = Trainer(
        LAYERS,
        gpt.loss_fn,
        TrainConfig(
            pp=pp,
            dp=dp,
            ep=ep,
            tp=tp,
            optimizer=SGD,
            seed=SEED,
            microbatches=M,
            cpus_per_actor=0.1,
            threads_per_actor=1,
        ),
    )
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def initial(trainer):
    return trainer.state_dict()


def test_state_dict_holds_every_expert_and_actors_hold_their_share(trainer, initial):
    dense = nn.Sequential(*build_layers(LAYERS, SEED)).state_dict()
    assert set(initial) == set(dense) and all(torch.equal(initial[k], dense[k]) for k in dense)
    assert sum(v.numel() for v in dense.values()) == gpt.GPTConfig(**BASE).parameters  # 4 MoE blocks
    for info in trainer.stage_info():
        rank = info["dp_rank"] % trainer.config.ep
        for layer, held in info["experts"].items():
            assert held == [2 * rank, 2 * rank + 1], (info["name"], layer, held)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_parity_with_the_one_process_model(trainer, initial, reference, schedule):
    ref = reference[trainer.config.dp]
    for zero in (0, 1) if schedule == "1f1b" else (0,):  # ZeRO-1 shards expert state among their holders
        trainer.reconfigure(zero=zero)
        check_sgd_parity(trainer, initial, ref, schedule, M, SGD, data=tokens)


@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_the_same_tokens_are_dropped_as_in_one_process(trainer, initial, recompute):
    """Routing and capacity per microbatch: replica 0 routes and drops exactly what the
    one-process model does on its microbatches, counted per expert, in every MoE layer (once,
    when activation checkpointing recomputes the forward and its all-to-alls in backward)."""
    trainer.reconfigure(schedule="1f1b", zero=0, activation_checkpointing=recompute)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    metrics = trainer.step(*tokens(0))
    expected = reference_routing(initial, trainer.config.dp)
    reported = {
        layer: (r["routed"], r["dropped"]) for stage in metrics["stages"] for layer, r in stage["experts"].items()
    }
    assert reported == expected
    assert sum(d for _, d in expected.values()) > 0  # the capacity layers really drop tokens
    assert all(stage["all_to_all_bytes"] > 0 and stage["all_to_all_s"] > 0 for stage in metrics["stages"])
    trainer.reconfigure(activation_checkpointing=False)


def test_zero_bubble_evaluation_and_generation_under_expert_parallelism(trainer, initial, reference):
    """ZB-H1 splits a MoE stage's backward (the all-to-all runs in the input-gradient half); a
    forward-only pass runs on replica 0 with its ep group beside it and gives the one-process loss
    and the one-process model's greedy tokens."""
    check_sgd_parity(trainer, initial, reference[trainer.config.dp], "zb-h1", M, SGD, data=tokens)
    model = nn.Sequential(*build_layers(LAYERS, SEED)).eval()
    model.load_state_dict(trainer.state_dict())
    x, y = tokens(5)
    with torch.no_grad():
        expected = sum(gpt.loss_fn(model(a), b).item() for a, b in zip(x.chunk(M), y.chunk(M))) / M
    assert abs(trainer.evaluate(x, y) - expected) < 1e-5
    prompt, ids = x[:2, :3], x[:2, :3]
    with torch.no_grad():  # greedy decoding in one process, a whole forward per token
        for _ in range(4):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(trainer.generate(prompt, max_new_tokens=4), ids)


def test_dualpipe_v_pairs_forwards_with_backwards_across_the_all_to_all(ray_session):
    """DualPipeV at pp 2 x dp 2 x ep 2: each MoE chunk's forward runs beside the other chunk's whole
    backward, both through their all-to-alls with the other ep replica, and the run is the
    one-process model's, tokens dropped alike (4 microbatches of one row per replica, 8 in one process)."""
    config = TrainConfig(
        pp=2,
        dp=2,
        ep=2,
        schedule="dualpipe-v",
        optimizer=SGD,
        seed=SEED,
        microbatches=4,
        cpus_per_actor=0.1,
        threads_per_actor=1,
    )
    reference = reference_run(LAYERS, SEED, sgd, steps=3, microbatches=8, loss_fn=gpt.loss_fn, data=tokens)
    with Trainer(LAYERS, gpt.loss_fn, config) as t:
        check_sgd_parity(t, t.state_dict(), reference, "dualpipe-v", 4, SGD, data=tokens)
        assert all(stage["all_to_all_bytes"] > 0 for stage in t.step(*tokens(3))["stages"])


# ----- checkpoints, reports ---------------------------------------------------------------


def test_checkpoint_at_ep2_resumes_at_ep1_and_back(ray_session, tmp_path):
    """Each layer's file holds all its experts under their global index, so ep can change."""
    config = dict(pp=2, dp=2, optimizer=SGD, seed=SEED, microbatches=M, cpus_per_actor=0.1, threads_per_actor=1, zero=1)
    expert = Trainer(LAYERS, gpt.loss_fn, TrainConfig(ep=2, **config))
    plain = Trainer(LAYERS, gpt.loss_fn, TrainConfig(ep=1, **config))
    try:
        expert.step(*tokens(0))
        saved = expert.save(str(tmp_path / "ep2"))
        plain.load(str(saved))
        assert_close_dicts(plain.state_dict(), expert.state_dict(), rtol=0, atol=0)
        torch.testing.assert_close(
            plain.step(*tokens(1))["loss"], expert.step(*tokens(1))["loss"], rtol=1e-5, atol=4e-5
        )
        assert_close_dicts(plain.state_dict(), expert.state_dict())  # momentum restored alike
        back = plain.save(str(tmp_path / "ep1"))
        expert.load(str(back))
        assert_close_dicts(expert.state_dict(), plain.state_dict(), rtol=0, atol=0)
        torch.testing.assert_close(
            expert.step(*tokens(2))["loss"], plain.step(*tokens(2))["loss"], rtol=1e-5, atol=4e-5
        )
    finally:
        expert.shutdown()
        plain.shutdown()


def test_compiled_engine_reports_tensorboard_timeline_and_diagram(ray_session, tmp_path):
    t = Trainer(
        LAYERS,
        gpt.loss_fn,
        TrainConfig(
            pp=2,
            dp=2,
            ep=2,
            optimizer=SGD,
            seed=SEED,
            microbatches=M,
            cpus_per_actor=0.1,
            threads_per_actor=1,
            log_dir=str(tmp_path / "tb"),
            engine="compiled",
        ),
    )
    try:
        metrics = t.step(*tokens(0))  # through a Ray compiled graph: the same first loss as one process
        ref_losses, _, _ = reference_run(
            LAYERS, SEED, sgd, steps=1, microbatches=2 * M, loss_fn=gpt.loss_fn, data=tokens
        )
        assert abs(metrics["loss"] - ref_losses[0]) < 4e-5
        line = t.timeline()
        assert any(span.kind == "A" for span in line.spans)
        assert "all-to-all (MoE)" in line.to_svg()
        assert any(e.get("cat") == "all-to-all" for e in line.to_chrome_trace()["traceEvents"])
        arch = Architecture.from_trainer(t, tokens(0)[0][:2])
        svg = arch.save(tmp_path / "moe.svg").read_text()  # rendered by Graphviz's dot
        assert "ep group 0, rank 1" in svg and "experts 2&#45;3" in svg and "MoE: 4 experts per layer" in svg
        t.shutdown()  # flushes the writer
        events = tensorboard_run(str(tmp_path / "tb"))
        tags = events.Tags()["scalars"]
        layer = next(iter(metrics["stages"][0]["experts"]))
        routed = metrics["stages"][0]["experts"][layer]["routed"]
        assert [events.Scalars(f"moe/layer{layer}/expert{e}_tokens")[0].value for e in range(4)] == routed
        assert f"moe/layer{layer}/dropped_tokens" in tags and "stage1/all_to_all_bytes" in tags
    finally:
        t.shutdown()


def test_narrow_boundaries_keep_scalars_and_routing_counts_exact():
    """boundary_dtype="bf16" narrows activations only: the aux loss a MoE model carries and
    Mixtral's routing counts (exact integers that bf16 would round above 256) keep float32."""
    from raypipe.actors.stage_model import StageModel
    from raypipe.actors.step.executor import Executor
    from raypipe.core.protocol import StageSettings
    from raypipe.nn import TensorParallelGroup

    model = StageModel(LAYERS[:2], 0, SEED, torch.device("cpu"), TensorParallelGroup())
    executor = Executor(model, 0, False, None, lambda: 1.0, "stage0")
    executor.settings = StageSettings(microbatches=1, optimizer={"name": "sgd", "lr": 0.1}, boundary_dtype="bf16")
    executor.begin(0)
    hidden, aux, counts = torch.randn(2, 8, 16), torch.tensor(0.123456789), torch.tensor([257.0, 1023.0])
    sent = executor.send((hidden, aux, counts))
    assert sent[0].dtype == torch.bfloat16 and sent[1].dtype == sent[2].dtype == torch.float32
    assert torch.equal(sent[2], counts) and sent[1].item() == aux.item()


def test_the_moe_job_file_trains(ray_session, tmp_path):
    """examples/configs/moe_gpt_ep2.yaml as `raypipe train` runs it, a few steps: the loss falls,
    evaluation and sampling run through the ep group, and its summary names the experts."""
    from raypipe.job import JobConfig, run

    overrides = [
        "job.steps=6",
        "job.eval_every=6",
        "job.eval_batches=1",
        "job.batch_size=8",
        "job.sample_tokens=8",
        "job.log_every=3",
        "data.max_bytes=200000",
        f"log_dir={tmp_path / 'tb'}",
        "job.progress=false",
        "cpus_per_actor=0.1",
        "threads_per_actor=1",
        "optimizer={name: adamw, lr: 0.01}",
        "lr_schedule={name: constant}",
    ]
    lines = []
    summary = run(JobConfig.from_yaml("examples/configs/moe_gpt_ep2.yaml", overrides), log=lines.append)
    assert summary["losses"][-1] < summary["losses"][0]
    assert any("val loss" in line for line in lines) and any(line.startswith("sample:") for line in lines), lines
    summary_line = next(line for line in lines if line.startswith("raypipe: ") and "pp=" in line)
    assert "2 MoE blocks of 8 experts, top 2" in summary_line and "dp=2 (ep=2)" in summary_line, summary_line
