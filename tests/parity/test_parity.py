"""Numerical parity with plain PyTorch for every pp, microbatch count, schedule and engine.

One trainer per pipeline depth is reused across schedules and microbatch counts
(`reconfigure`, `reset_optimizer`, `load_state_dict`), which also tests those. The
default engine ("p2p": one call per actor per step, tensors sent actor to actor, through
shared memory on one node) runs at pp = 1 and 4, the "compiled" engine (the same step
through a Ray Compiled Graph) at pp = 2 with gloo between the stages, the "refs" engine
(one call per action, tensors as object references) at pp=3; failures name the stage
that failed, and under p2p its neighbours stop too.
"""

import pytest
import torch
from torch import nn

from raypipe import TrainConfig, Trainer, build_layers
from raypipe.driver.links.advice import direction_bytes
from raypipe.transport.compress import compress

from helpers import MLP7, assert_close_dicts, batch, check_sgd_parity, reference_run

SEED = 7
SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(
    scope="module",
    params=[(1, "p2p", "shm"), (2, "compiled", "gloo"), (4, "p2p", "shm"), (3, "refs", "shm")],
    ids=lambda p: f"pp{p[0]}-{p[1]}-{p[2]}",
)
def trainer(request, ray_session):
    pp, engine, transport = request.param
    t = Trainer(
        MLP7,
        nn.functional.mse_loss,
        TrainConfig(pp=pp, engine=engine, same_node_transport=transport, optimizer=SGD, seed=SEED),
    )
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def initial():
    return nn.Sequential(*build_layers(MLP7, SEED)).state_dict()


@pytest.fixture(scope="module")
def sgd_reference():
    return reference_run(MLP7, SEED, sgd, steps=3)


def test_initial_weights_do_not_depend_on_the_split(trainer, initial):
    assert trainer.num_stages == trainer.config.pp
    state = trainer.state_dict()
    assert list(state) == list(initial)  # same keys, same order as nn.Sequential
    for key in initial:
        assert torch.equal(state[key], initial[key]), key


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 8])
def test_sgd_momentum_parity(trainer, initial, sgd_reference, schedule, microbatches):
    """At 8 microbatches a p2p trainer runs the 3 steps as one run its actors drive (`actor_steps`,
    at pp 1 a lone actor with no world to agree with)."""
    actors = microbatches == 8 and trainer.config.engine == "p2p"
    check_sgd_parity(trainer, initial, sgd_reference, schedule, microbatches, SGD, actors=actors)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_adamw_parity_against_accumulated_microbatches(trainer, initial, schedule):
    adamw = {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1}
    trainer.reconfigure(schedule=schedule, microbatches=4, optimizer=adamw)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    losses = [trainer.step(*batch(k))["loss"] for k in range(3)]
    ref_losses, _, ref_final = reference_run(
        MLP7,
        SEED,
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
        steps=3,
        microbatches=4,
        reverse=schedule == "gpipe",
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
    assert_close_dicts(trainer.state_dict(), ref_final)


def test_global_gradient_clipping_matches_torch(trainer, initial):
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD, grad_clip=0.05)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    metrics = [trainer.step(*batch(k)) for k in range(3)]
    trainer.reconfigure(grad_clip=None)
    ref_losses, ref_grads, ref_final = reference_run(MLP7, SEED, sgd, steps=3, grad_clip=0.05)
    assert metrics[0]["grad_norm"] > 0.05  # clipping really happened
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses))
    assert_close_dicts(trainer.state_dict(), ref_final)


def test_activation_checkpointing_recomputes_and_changes_nothing_numerically(trainer, initial, sgd_reference):
    """Recomputing in backward: what autograd keeps for the stashed microbatches shrinks (saved-tensor
    hooks count it), and losses and weights stay those of plain PyTorch."""
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD, measure_activations=True)
    kept = [s["peak_stashed_bytes"] for s in trainer.step(*batch(0))["stages"]]
    trainer.reconfigure(activation_checkpointing=True)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    metrics = [trainer.step(*batch(k)) for k in range(3)]
    trainer.reconfigure(activation_checkpointing=False, measure_activations=False)
    recomputed = [s["peak_stashed_bytes"] for s in metrics[0]["stages"]]
    # a stage keeps its input only: a stage that also kept a tanh's output keeps half (the layers'
    # own weights, which a linear saves too, are not activations and were never counted)
    assert all(r <= k for r, k in zip(recomputed, kept)) and any(r <= 0.5 * k for r, k in zip(recomputed, kept)), (
        recomputed,
        kept,
    )
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics]), torch.tensor(sgd_reference[0]), rtol=1e-5, atol=4e-5
    )
    assert_close_dicts(trainer.state_dict(), sgd_reference[2])


def test_evaluate_and_predict_match_the_one_process_model(trainer, initial):
    trainer.load_state_dict(initial)
    model = nn.Sequential(*build_layers(MLP7, SEED))
    x, y = batch(5)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(trainer.predict(x), expected)
    trainer.reconfigure(microbatches=4)
    assert trainer.evaluate(x, y) == pytest.approx(nn.functional.mse_loss(expected, y).item(), rel=1e-5)
    assert all(torch.equal(v, initial[k]) for k, v in trainer.state_dict().items())  # no training


class _RoundTrip(torch.autograd.Function):
    """What a bf16 stage boundary does: the activation and, in backward, its gradient are rounded."""

    @staticmethod
    def forward(ctx, x):
        return x.bfloat16().float()

    @staticmethod
    def backward(ctx, grad):
        return grad.bfloat16().float()


def test_bf16_boundaries_round_exactly_there_and_halve_the_bytes_sent(trainer, initial):
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD)
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    fp32_sent = [s["sent_bytes"] for s in trainer.step(*batch(0))["stages"]]
    trainer.reconfigure(boundary_dtype="bf16")
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    metrics = [trainer.step(*batch(k)) for k in range(3)]
    trainer.reconfigure(boundary_dtype="fp32")
    assert [s["sent_bytes"] for s in metrics[0]["stages"]] == [b // 2 for b in fp32_sent]
    assert all(s["fp32_sent_bytes"] == 0 for s in metrics[0]["stages"])  # nothing left for "auto" to halve
    pp = trainer.num_stages
    assert (fp32_sent[0] > 0) == (pp > 1)

    assert_rounded_where_stages_meet(trainer, metrics, _RoundTrip.apply)


def assert_rounded_where_stages_meet(trainer, metrics, rounding):
    """The trainer's 3 steps (`metrics`, from `initial`) are one process's with `rounding` applied to
    the output of each stage's last layer (and its gradient), and differ from the unrounded run."""

    def round_at_boundaries(model):
        for _, end in trainer.plan[:-1]:
            model[end - 1].register_forward_hook(lambda module, args, out: rounding(out))

    ref_losses, _, ref_final = reference_run(MLP7, SEED, sgd, steps=3, microbatches=4, prepare=round_at_boundaries)
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5
    )
    assert_close_dicts(trainer.state_dict(), ref_final)
    _, _, unrounded = reference_run(MLP7, SEED, sgd, steps=3, microbatches=4)
    moved = max(float((trainer.state_dict()[k] - unrounded[k]).abs().max()) for k in unrounded)
    assert (moved > 1e-6) == (trainer.num_stages > 1), moved  # the rounding is real, and only where stages meet


class _Compressed(torch.autograd.Function):
    """What compressed boundaries do to a value and its gradient (`raypipe.transport.compress`)."""

    @staticmethod
    def forward(ctx, x, activations, gradients):
        ctx.gradients = gradients
        return compress(x, activations).restore()

    @staticmethod
    def backward(ctx, grad):
        return compress(grad, ctx.gradients).restore(), None, None


def test_compressed_boundaries_round_exactly_there_and_send_a_quarter_of_the_bytes(trainer, initial):
    """fp8 activations with a scale per row, int8 gradients, on every engine and transport: the
    losses and weights of one process rounding the same values the same way, 20 bytes per 16-wide
    row (16 + a float32 scale) instead of 64."""
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD)
    trainer.reconfigure(compress_activations="fp8-row", compress_gradients="int8")
    trainer.reset_optimizer()
    trainer.load_state_dict(initial)
    metrics = [trainer.step(*batch(k)) for k in range(3)]
    trainer.reconfigure(compress_activations="none", compress_gradients="none")
    if trainer.num_stages > 1:
        assert metrics[0]["stages"][0]["sent_bytes"] == 4 * 4 * (16 + 4)  # the first stage's output: 16 wide
    assert_rounded_where_stages_meet(trainer, metrics, lambda out: _Compressed.apply(out, "fp8-row", "int8"))


def test_timeline_and_sent_bytes_come_from_the_actors(trainer, initial):
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD)
    metrics = trainer.step(*batch(0))
    assert len(trainer.timeline().spans) == 2 * 4 * trainer.num_stages  # every F and B, measured on its actor
    sent = [s["sent_bytes"] for s in metrics["stages"]]
    if trainer.num_stages > 1:  # the first stage's output is 16 wide in every plan of MLP7
        assert sent[0] == 4 * 4 * 16 * 4  # 4 microbatches of 4 x 16 fp32 activations, no gradient back
        assert all(b > 0 for b in sent)
    assert [s["fp32_sent_bytes"] for s in metrics["stages"]] == sent  # boundary_dtype "auto", not narrowed here
    # each direction's bytes as the link advice reads them from the stages' sums: every boundary's
    # activations on, as many bytes of their gradients back
    widths = [16, 16, 16, 16, 12, 12, 3]  # MLP7's layers' outputs
    each = {}
    for s, (_, end) in enumerate(trainer.plan[:-1]):
        each[(s, s + 1)] = each[(s + 1, s)] = 4 * 4 * widths[end - 1] * 4
    assert direction_bytes(sent, trainer.config) == each


def test_stages_on_one_node_are_linked_through_shared_memory_unless_told_otherwise(trainer):
    cfg = trainer.config
    linked = [info["shm_peers"] for info in trainer.stage_info()]
    if cfg.engine == "refs" or cfg.same_node_transport == "gloo":
        assert linked == [[]] * cfg.pp
    else:  # every stage with its neighbours, all on this one node
        assert linked == [[n for n in (s - 1, s + 1) if 0 <= n < cfg.pp] for s in range(cfg.pp)]


def test_a_failing_stage_is_named_and_its_neighbours_do_not_hang(trainer, initial):

    from raypipe import StageError

    x, y = batch(0)
    trainer.reconfigure(schedule="1f1b", microbatches=4, optimizer=SGD)
    last = trainer.num_stages - 1
    with pytest.raises(StageError, match=rf"stage{last}-dp0-tp0 failed at {last}F0: .*size"):
        trainer.step(x, torch.randn(16, 4))  # targets that do not match the output
    with pytest.raises(StageError, match=r"stage0-dp0-tp0 failed at 0F0: RuntimeError: .*shapes"):
        trainer.step(torch.randn(16, 5), y)  # 5 features where the first layer takes 6
    trainer.load_state_dict(initial)  # and it keeps working: the next step is exactly a first step
    trainer.reset_optimizer()
    trainer.step(x, y)
    _, _, expected = reference_run(MLP7, SEED, sgd, steps=1, microbatches=4)
    assert_close_dicts(trainer.state_dict(), expected)
