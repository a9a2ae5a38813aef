"""Device links: boundary values on streams of their own, matched in order (`transport.ordered`),
the path two CUDA stages on different GPUs take over NCCL. On this CPU machine
`device_links="nccl"` runs the same streams over gloo, so every part but the device copies is
checked here: parity with one process under interleaved 1F1B (six streams between two actors,
two of them the same way at once), ZB-H1, 1F1B and GPipe at dp 2, and the compiled engine; a
failed step that leaves every stream in step for the next; a stage killed mid-step, whose
recovery makes new streams and replays the uninterrupted losses; the links reported and drawn. The
choice of link from where actors run (GPUs shared or not, mixed kinds) is checked without Ray."""

import pytest
import torch
from torch import nn

from raypipe import LayerSpec, PlacementError, StageError, TrainConfig, Trainer
from raypipe.core.protocol import ActorInfo
from raypipe.driver.cluster.topology import Topology
from raypipe.driver.links import ways
from raypipe.models import gpt
from raypipe.observe.diagram import Architecture
from raypipe.schedules import build_schedule

from helpers import MLP7, KillOnce, batch, check_sgd_parity, lm_tokens, reference_run

SEED = 11
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
GPT = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16)
LAYERS = gpt.layers(GPT)


def tokens(k: int, size: int = 16):
    return lm_tokens(GPT, k, size, seed=900)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def config(**kwargs) -> TrainConfig:
    # a stream out of step hangs: fail within a minute instead
    return TrainConfig(
        optimizer=SGD,
        seed=SEED,
        cpus_per_actor=0.1,
        threads_per_actor=1,
        device_links="nccl",
        step_timeout=60,
        **kwargs,
    )


@pytest.fixture(scope="module")
def reference():
    return {
        m: reference_run(LAYERS, SEED, sgd, steps=3, microbatches=m, loss_fn=gpt.loss_fn, data=tokens) for m in (4, 8)
    }


@pytest.fixture(scope="module")
def interleaved(ray_session):
    with Trainer(LAYERS, gpt.loss_fn, config(pp=2, schedule="interleaved-1f1b", microbatches=4)) as t:
        yield t, t.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [4, 8])
def test_interleaved_chunks_on_ordered_streams_train_like_one_process(interleaved, reference, microbatches):
    trainer, initial = interleaved
    check_sgd_parity(trainer, initial, reference[microbatches], "interleaved-1f1b", microbatches, SGD, data=tokens)


@pytest.mark.slow
def test_the_links_are_reported_and_drawn_as_ordered_streams(interleaved):
    trainer, _ = interleaved
    info = {i["name"]: i for i in trainer.stage_info()}
    assert info["stage0-dp0-tp0"]["links"] == {"stage1-dp0-tp0": "gloo (ordered)"}
    assert info["stage1-dp0-tp0"]["links"] == {"stage0-dp0-tp0": "gloo (ordered)"}
    assert info["stage0-dp0-tp0"]["shm_peers"] == []  # nothing went through shared memory instead
    assert "over gloo (ordered)" in Architecture.from_trainer(trainer).to_mermaid()


@pytest.mark.slow
def test_a_failed_step_leaves_every_stream_in_step(interleaved, reference):
    trainer, initial = interleaved
    trainer.reconfigure(schedule="interleaved-1f1b", microbatches=4)
    x, y = tokens(0)
    bad = y.clone()
    bad[-1, 0] = GPT.vocab_size + 5  # the last microbatch's loss indexes out of range, mid-step
    with pytest.raises(StageError, match=r"stage1-dp0-tp0 failed at 3F3"):
        trainer.step(x, bad)
    # poison went where values would have, message for message: the next steps match exactly
    check_sgd_parity(trainer, initial, reference[4], "interleaved-1f1b", 4, SGD, data=tokens)


@pytest.mark.slow
def test_split_backwards_at_dp2_on_ordered_streams_train_like_one_process(ray_session, reference):
    with Trainer(LAYERS, gpt.loss_fn, config(pp=2, dp=2, schedule="zb-h1", microbatches=4)) as trainer:
        initial = trainer.state_dict()
        for schedule in ("zb-h1", "1f1b", "gpipe"):
            check_sgd_parity(trainer, initial, reference[8], schedule, 4, SGD, data=tokens)
        links_of = {i["name"]: i["links"] for i in trainer.stage_info()}
    assert links_of["stage1-dp1-tp0"] == {"stage0-dp1-tp0": "gloo (ordered)"}


@pytest.mark.slow
def test_the_compiled_engine_runs_ordered_streams(ray_session):
    reference = reference_run(MLP7, SEED, sgd, steps=3, microbatches=4)
    with Trainer(MLP7, nn.functional.mse_loss, config(pp=3, engine="compiled", microbatches=4)) as trainer:
        check_sgd_parity(trainer, trainer.state_dict(), reference, "1f1b", 4, SGD)


@pytest.mark.slow
def test_a_recovery_makes_new_streams_and_replays_the_uninterrupted_losses(ray_session, tmp_path):
    flag = tmp_path / "kill-now"
    layers = MLP7[:4] + [LayerSpec(KillOnce, str(flag))] + MLP7[4:]  # in stage 1

    def run(root, on_step=None):
        cfg = config(pp=2, microbatches=2, checkpoint_dir=str(root), checkpoint_every=2, max_restarts=1)
        with Trainer(layers, nn.functional.mse_loss, cfg) as t:
            history = t.fit(batch, 6, on_step=on_step and (lambda m: on_step(t, m)), log=lambda _: None)
            return t.restarts, history, [i["links"] for i in t.stage_info()]

    def kill_in_step_4(trainer, metrics):
        if metrics["step"] == 3 and trainer.restarts == 0:
            flag.touch()  # stage 1 SIGKILLs itself in step 4's first forward, its streams half used

    _, uninterrupted, _ = run(tmp_path / "a")
    restarts, history, linked = run(tmp_path / "b", kill_in_step_4)
    assert restarts == 1
    assert linked == [{"stage1-dp0-tp0": "gloo (ordered)"}, {"stage0-dp0-tp0": "gloo (ordered)"}]
    replayed = [loss for _, loss in sorted({m["step"]: m["loss"] for m in history}.items())]
    torch.testing.assert_close(
        torch.tensor(replayed), torch.tensor([m["loss"] for m in uninterrupted]), rtol=1e-6, atol=1e-6
    )


# ----- which links go on the device (no Ray) ----------------------------------------------------


def infos(*where):
    """Actor infos from (device, node, GPU id) triples."""
    return [ActorInfo(name=f"actor{r}", device=d, node_id=n, gpu=g) for r, (d, n, g) in enumerate(where)]


def streams_of(plan):
    return [(s.sender, s.receiver, s.v, s.what, s.backend) for s in plan.streams]


def test_cuda_stages_on_their_own_gpus_link_on_the_device_one_stream_per_direction():
    topology, schedule = Topology(pp=3, dp=1, tp=1), build_schedule("1f1b", 3, 4)
    where = infos(("cuda:0", "n1", "GPU-a"), ("cuda:0", "n1", "GPU-b"), ("cuda:0", "n2", "GPU-a"))
    plan = ways.plan_links(topology, schedule, where, ["s0", "s1", "s2"], "auto")
    assert streams_of(plan) == [
        (0, 1, 0, "F", "nccl"),
        (1, 0, 1, "G", "nccl"),
        (1, 2, 1, "F", "nccl"),
        (2, 1, 2, "G", "nccl"),
    ]
    assert [i for i, _ in plan.of(1)] == [0, 1, 2, 3] and [i for i, _ in plan.of(2)] == [2, 3]
    assert ways.plan_links(topology, schedule, where, ["s0", "s1", "s2"], "host").streams == []


def test_stages_sharing_a_gpu_or_of_mixed_kinds_go_through_host_memory():
    topology, schedule = Topology(pp=3, dp=1, tp=1), build_schedule("1f1b", 3, 4)
    where = infos(("cuda:0", "n1", "GPU-a"), ("cuda:0", "n1", "GPU-a"), ("mps", "n2", None))
    assert ways.plan_links(topology, schedule, where, ["s0", "s1", "s2"], "auto").streams == []
    with pytest.raises(PlacementError, match=r"s0 and s1 share one GPU.*gpus_per_actor=1.*device_links='auto'"):
        ways.plan_links(topology, schedule, where, ["s0", "s1", "s2"], "nccl")
    # asked for on host stages, the streams run over gloo; a GPU to a Mac never goes on them
    cpu = infos(("cpu", "n1", None), ("cuda:0", "n1", "GPU-b"), ("mps", "n2", None))
    assert streams_of(ways.plan_links(Topology(pp=3, dp=1, tp=1), schedule, cpu, ["a", "b", "c"], "nccl")) == []
    cpus = infos(("cpu", "n1", None), ("cpu", "n1", None), ("mps", "n2", None))
    assert {s[4] for s in streams_of(ways.plan_links(topology, schedule, cpus, ["a", "b", "c"], "nccl"))} == {"gloo"}


def test_a_collective_group_with_two_members_on_one_gpu_reduces_over_gloo():
    where = infos(("cuda:0", "n1", "GPU-a"), ("cuda:0", "n1", "GPU-a"), ("cuda:0", "n2", "GPU-a"), ("mps", "n3", None))
    assert ways.group_backend(where, [0, 2]) == "nccl"  # the same GPU model on two nodes is two GPUs
    assert ways.group_backend(where, [0, 1]) == "gloo"  # NCCL: "Duplicate GPU detected"
    assert ways.group_backend(where, [2, 3]) == "gloo"
    assert ways.group_backend(infos(("cpu", "n1", None), ("cpu", "n1", None)), [0, 1]) == "gloo"


def test_each_dp_replica_and_tp_rank_gets_its_own_streams():
    topology, schedule = Topology(pp=2, dp=2, tp=2), build_schedule("1f1b", 2, 4)
    where = infos(*[("cuda:0", "n1", f"GPU-{r}") for r in range(8)])
    plan = ways.plan_links(topology, schedule, where, [str(r) for r in range(8)], "auto")
    pairs = {(s.sender, s.receiver) for s in plan.streams if s.what == "F"}
    assert pairs == {(topology.rank(d, 0, t), topology.rank(d, 1, t)) for d in range(2) for t in range(2)}
    assert len(plan.streams) == 8
