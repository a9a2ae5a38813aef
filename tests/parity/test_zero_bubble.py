"""Interleaved 1F1B, ZB-H1, ZB-V and DualPipeV on real actors: exact parity with the reference GPT trained in
one process (losses, first-step gradients, weights after 3 SGD-momentum steps; rtol 1e-5, atol
4e-5) at pp 2 and 4, m 4 and 8, two chunks per actor where chunks apply, with dp 2 (and ZeRO-1)
and tp 2; each actor's stashed microbatches as its schedule bounds them; composition with
activation checkpointing, bf16 autocast, bf16 boundaries and the compiled engine; checkpoints
that resume under another schedule at another pp; a failure inside a V that stops every actor."""

import pytest
import torch

from raypipe import ConfigError, LayerSpec, StageError, TrainConfig, Trainer, build_schedule, peak_in_flight
from raypipe.models import gpt

from helpers import WorkClock, assert_close_dicts, check_sgd_parity, lm_tokens, reference_run

SEED = 11
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
GPT = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=6, n_head=2, n_embd=16)  # 8 layers: pp 4 x 2 chunks
LAYERS = gpt.layers(GPT)


def tokens(k: int, size: int = 16):
    return lm_tokens(GPT, k, size, seed=900)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.fixture(scope="module")
def reference():
    return {
        m: reference_run(LAYERS, SEED, sgd, steps=3, microbatches=m, loss_fn=gpt.loss_fn, data=tokens) for m in (4, 8)
    }


def config(**kwargs) -> TrainConfig:
    return TrainConfig(optimizer=SGD, seed=SEED, cpus_per_actor=0.1, threads_per_actor=1, **kwargs)


# (pp, schedule the trainer is built with, dp, tp); a trainer built for zb-h1 also runs 1f1b and gpipe
TRAINERS = [
    (2, "interleaved-1f1b", 1, 1),
    (2, "zb-v", 1, 1),
    (2, "zb-h1", 1, 1),
    (4, "interleaved-1f1b", 1, 1),
    (4, "zb-v", 1, 1),
    (4, "zb-h1", 1, 1),
    (2, "zb-v", 2, 1),
    (2, "interleaved-1f1b", 1, 2),
    (2, "zb-h1", 2, 2),
    (2, "zb-v", 1, 2),
]


@pytest.fixture(scope="module", params=TRAINERS, ids=lambda p: f"pp{p[0]}-{p[1]}-dp{p[2]}-tp{p[3]}")
def trainer(request, ray_session):
    pp, schedule, dp, tp = request.param
    t = Trainer(LAYERS, gpt.loss_fn, config(pp=pp, dp=dp, tp=tp, zero=int(dp > 1), schedule=schedule, microbatches=4))
    yield t
    t.shutdown()


@pytest.fixture(scope="module")
def initial(trainer):
    return trainer.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [4, 8])
def test_parity_with_one_process(trainer, initial, reference, microbatches):
    """A ZB-V trainer runs DualPipeV too: the same V of chunks, another order (its F&B pairs).
    At 8 microbatches every trainer's own schedule runs its 3 steps as one run the actors drive
    (`actor_steps`: losses and final weights; gradients are checked step by step at 4 and under
    DualPipeV). At pp 2 the layers also run compiled (`compile=True`, inductor) under every schedule of the
    trainer's layout, each one's split backward included, at the same tolerance: in one process
    compiled and eager blocks differ by < 5e-7 of a weight after 3 steps (fused kernels sum in
    another order)."""
    assert set(initial) == set(reference[4][2])
    c = trainer.config
    own = c.schedule
    for schedule in (own, "dualpipe-v") if own == "zb-v" else (own,):
        actors = microbatches == 8 and schedule == own
        check_sgd_parity(trainer, initial, reference[microbatches], schedule, microbatches, SGD, tokens, actors)
    if (c.pp, c.dp, c.tp, microbatches) == (2, 1, 1, 4):
        trainer.reconfigure(compile=True)
        for schedule in {"zb-h1": ("gpipe", "1f1b", "zb-h1"), "zb-v": ("zb-v", "dualpipe-v")}.get(own, (own,)):
            check_sgd_parity(trainer, initial, reference[4], schedule, 4, SGD, data=tokens)
        compiled = trainer.step(*tokens(0))["stages"][0]["compiled"]
        assert compiled["graphs"] >= 2 and compiled["graph_breaks"] == 0, compiled
        trainer.reconfigure(compile=False)
        assert "compiled" not in trainer.step(*tokens(0))["stages"][0]
    trainer.reconfigure(schedule=own)


@pytest.mark.slow
def test_each_actor_stashes_what_its_schedule_bounds(trainer, initial):
    c = trainer.config
    trainer.reconfigure(microbatches=8)
    stages = trainer.step(*tokens(0))["stages"]
    planned = [peak_in_flight(a) for a in build_schedule(c.schedule, c.pp, 8, c.chunks)]
    assert [s["peak_stashed_microbatches"] for s in stages] == planned
    awaiting = [s["peak_awaiting_weight_grad"] for s in stages]
    assert (
        all(0 < a <= p for a, p in zip(awaiting, planned))
        if c.schedule != "interleaved-1f1b"
        else awaiting == [0] * c.pp
    )
    if c.schedule == "zb-h1":
        assert planned == [c.pp] * c.pp  # 1F1B's first stage, on every actor
    if c.schedule == "zb-v":
        assert planned == [2 * c.pp] * c.pp  # 2p half-stage chunks: the same memory
    trainer.load_state_dict(initial)


def test_the_flat_layout_switches_between_1f1b_gpipe_and_zb_h1_but_not_to_chunks(trainer):
    if trainer.config.schedule in ("zb-h1",):
        for schedule in ("1f1b", "gpipe", "zb-h1"):
            trainer.reconfigure(schedule=schedule)
    with pytest.raises(ConfigError, match="changing chunks needs a new Trainer"):
        other = "zb-v" if trainer.config.schedule != "zb-v" else "1f1b"
        trainer.reconfigure(schedule=other)
    assert trainer.config.schedule in ("zb-h1", "zb-v", "interleaved-1f1b")  # unchanged after the refusal


def test_chunks_hold_the_layers_of_their_virtual_stages(trainer):
    c = trainer.config
    info = trainer.stage_info()
    replica0 = [i for i in info if i["dp_rank"] == 0 and i["tp_rank"] == 0]
    if c.schedule == "zb-v" and c.pp == 4:
        assert [i["virtual_stages"] for i in replica0] == [[0, 7], [1, 6], [2, 5], [3, 4]]
        assert [i["layers"] for i in replica0] == [[(0, 1), (7, 8)], [(1, 2), (6, 7)], [(2, 3), (5, 6)], (3, 5)]
    if c.schedule == "interleaved-1f1b" and c.pp == 2:
        assert [i["virtual_stages"] for i in replica0] == [[0, 2], [1, 3]]
        assert [i["layers"] for i in replica0] == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    if c.dp == c.tp == 1:  # every stream between two actors on one node goes through shared memory
        linked = {
            "interleaved-1f1b": [[1, c.pp - 1], [0, 2], [1, 3], [0, 2]][: c.pp] if c.pp == 4 else [[1], [0]],
            "zb-v": [[1], [0, 2], [1, 3], [2]][: c.pp] if c.pp == 4 else [[1], [0]],
        }.get(c.schedule)
        if linked is not None:
            assert [i["shm_peers"] for i in replica0] == linked


# ----- composition ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zbv(ray_session):
    t = Trainer(LAYERS, gpt.loss_fn, config(pp=2, schedule="zb-v", microbatches=4))
    yield t
    t.shutdown()


@pytest.mark.slow
def test_activation_checkpointing_bf16_and_compiled_layers_compose_with_split_backwards(zbv, reference):
    """Each alone and compiled: activation checkpointing (a compiled block recomputed in its
    backward), bf16 autocast, and sequences of three other lengths (one recompile to dynamic
    shapes, none after), losses as eager's."""
    start = zbv.state_dict()
    for compiled in (False, True):
        zbv.reconfigure(activation_checkpointing=True, compile=compiled)
        check_sgd_parity(zbv, start, reference[4], "zb-v", 4, SGD, data=tokens)
    bf16 = reference_run(LAYERS, SEED, sgd, steps=3, microbatches=4, loss_fn=gpt.loss_fn, data=tokens, precision="bf16")
    for compiled in (False, True):
        zbv.reconfigure(activation_checkpointing=False, precision="bf16", compile=compiled)
        zbv.reset_optimizer()
        zbv.load_state_dict(start)
        losses = [zbv.step(*tokens(k))["loss"] for k in range(3)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(bf16[0]), rtol=1e-3, atol=1e-3)
    zbv.reconfigure(precision="fp32")
    x, y = tokens(4)
    by_length, graphs = {}, []
    for compiled in (False, True):
        zbv.reconfigure(compile=compiled)
        for length in (8, 6, 5, 7):
            zbv.load_state_dict(start)
            metrics = zbv.step(x[:, :length].contiguous(), y[:, :length].contiguous())
            by_length.setdefault(length, []).append(metrics["loss"])
            graphs.append(metrics["stages"][0].get("compiled", {}).get("graphs"))
    assert all(abs(eager - fast) < 1e-5 for eager, fast in by_length.values()), by_length
    assert graphs[:4] == [None] * 4 and graphs[4] < graphs[5] == graphs[6] == graphs[7], graphs
    zbv.reconfigure(compile=False)
    zbv.load_state_dict(start)


@pytest.mark.slow
def test_repeated_runs_agree_bit_for_bit(zbv):
    """Split backwards accumulate weight gradients in the schedule's order whatever the timing:
    two runs from the same start give the same losses and weights, bit for bit."""
    start = zbv.state_dict()
    runs = []
    for _ in range(2):
        zbv.reset_optimizer()
        zbv.load_state_dict(start)
        losses = [zbv.step(*tokens(k))["loss"] for k in range(2)]
        runs.append((losses, zbv.state_dict()))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in start)
    zbv.load_state_dict(start)


@pytest.mark.slow
def test_bf16_boundaries_give_zb_h1_what_they_give_1f1b(ray_session):
    with Trainer(LAYERS, gpt.loss_fn, config(pp=3, schedule="zb-h1", microbatches=4, boundary_dtype="bf16")) as t:
        start, runs = t.state_dict(), {}
        for schedule in ("1f1b", "zb-h1"):
            t.reconfigure(schedule=schedule)
            t.reset_optimizer()
            t.load_state_dict(start)
            runs[schedule] = ([t.step(*tokens(k))["loss"] for k in range(3)], t.state_dict())
        torch.testing.assert_close(torch.tensor(runs["zb-h1"][0]), torch.tensor(runs["1f1b"][0]), rtol=1e-5, atol=4e-5)
        assert_close_dicts(runs["zb-h1"][1], runs["1f1b"][1])


@pytest.mark.slow
def test_compiled_engine_runs_a_v(ray_session, reference):
    with Trainer(LAYERS, gpt.loss_fn, config(pp=2, schedule="zb-v", microbatches=4, engine="compiled")) as t:
        check_sgd_parity(t, t.state_dict(), reference[4], "zb-v", 4, SGD, data=tokens)


def test_refs_engine_and_mismatched_chunks_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="engine.*p2p and compiled engines"):
        TrainConfig(pp=2, schedule="zb-v", engine="refs")
    with pytest.raises(ConfigError, match="chunks.*always runs 2 per actor"):
        TrainConfig(pp=2, schedule="zb-v", chunks=3)
    with pytest.raises(ConfigError, match="microbatches.*divisible by pp"):
        TrainConfig(pp=4, schedule="interleaved-1f1b", microbatches=6)
    with pytest.raises(ConfigError, match="shard_plan.*one range per virtual stage"):
        TrainConfig(pp=2, schedule="zb-v", shard_plan=[[0, 4], [4, 8]])


@pytest.mark.slow
def test_a_zb_v_checkpoint_resumes_under_1f1b_at_another_pp(zbv, tmp_path):
    zbv.reconfigure(checkpoint_dir=str(tmp_path))
    zbv.step(*tokens(0))
    where = zbv.save()
    after = zbv.step(*tokens(1))["loss"]
    saved_weights = zbv.state_dict()
    zbv.reconfigure(checkpoint_dir=None)  # gives the directory up: one live run writes there at a time
    # the same run goes on in another trainer: resume, since the directory holds the run's checkpoint
    with Trainer(
        LAYERS, gpt.loss_fn, config(pp=3, schedule="1f1b", microbatches=4, checkpoint_dir=str(tmp_path), resume=True)
    ) as t:
        assert t.restored_from[0] == where and t.run_id == zbv.run_id
        assert t.step(*tokens(1))["loss"] == pytest.approx(after, rel=1e-5, abs=4e-5)  # momentum carried over
        assert_close_dicts(t.state_dict(), saved_weights)


@pytest.mark.slow
def test_a_failure_inside_a_v_stops_every_actor_and_names_the_stage(zbv):
    x, y = tokens(0)
    bad = y.clone()
    bad[0, 0] = GPT.vocab_size + 5  # the loss, on actor 0's second chunk, indexes out of range
    with pytest.raises(StageError, match=r"stage0-dp0-tp0 failed at 3F0"):
        zbv.step(x, bad)
    zbv.step(x, y)  # every actor is still in step


# ----- partitioning and drawing per virtual stage (no actors) ---------------------------------


def test_profiled_plans_split_per_virtual_stage_and_predict_by_simulating_the_schedule():
    """Eight layers, the last four three times slower, in a V of four virtual stages. Balancing each
    chunk alone ([0,3) [3,5) [5,6) [6,8)) leaves actor 0 with 0.27 s of the 0.48 per microbatch; the
    plan balances the actors (0.24 each) and beats both that and the uniform split, as the
    schedule's own timed run (the prediction) says."""
    from raypipe.planning.profiling import plan_from_profiles, scheduled_seconds

    layer = [0.01] * 4 + [0.03] * 4
    profile = {
        "forward_s": layer,
        "backward_s": [2 * t for t in layer],
        "parameter_bytes": [1000] * 8,
        "activation_bytes": [100] * 8,
        "memory_bytes": 2**30,
        "model": "test cpu",
        "cpu_fallback": False,
    }
    cfg = TrainConfig(pp=2, schedule="zb-v", microbatches=4, partition="profile")
    report = plan_from_profiles({"cpu": profile}, ["cpu", "cpu"], cfg)
    assert report.stages == [0, 1, 1, 0] and report.kinds == ["cpu"] * 4
    loads = [report.stage_seconds[0] + report.stage_seconds[3], report.stage_seconds[1] + report.stage_seconds[2]]
    assert loads == pytest.approx([0.24, 0.24])

    def predicted(plan):
        return scheduled_seconds(build_schedule("zb-v", 2, 4), [profile] * 4, plan)

    assert report.step_seconds == pytest.approx(predicted(report.plan))
    assert report.step_seconds < predicted([(0, 3), (3, 5), (5, 6), (6, 8)])
    assert (
        report.step_seconds < report.uniform_step_seconds == pytest.approx(predicted([(0, 2), (2, 4), (4, 6), (6, 8)]))
    )
    assert f"virtual stage 3 (stage 0): layers [{report.plan[3][0]}, 8) on cpu" in str(report)


def test_the_diagram_draws_each_virtual_stage_on_its_actor(dot, tmp_path):
    from raypipe.observe.diagram import Architecture

    sample = torch.zeros(2, GPT.block_size, dtype=torch.long)
    arch = Architecture.from_config(LAYERS, TrainConfig(pp=2, schedule="zb-v", microbatches=4), sample)
    assert [s.heading for s in arch.stages] == [
        "virtual stage 0 on stage 0",
        "virtual stage 1 on stage 1",
        "virtual stage 2 on stage 1",
        "virtual stage 3 on stage 0",
    ]
    svg = arch.save(tmp_path / "v.svg").read_text()  # Graphviz renders it
    assert "virtual stage 3 on stage 0" in svg and "(2, 8, 16) float32" in svg


def test_where_the_cores_set_the_step_auto_takes_the_lighter_of_tied_schedules():
    """Four actors' CPU work on one shared core: every schedule's step is that work, so GPipe and
    1F1B tie, and 1F1B, stashing fewer microbatches, is chosen; the schedules with more actions
    (split backwards, chunks) cost more of the core and lose."""
    from raypipe.planning.autoschedule import rank

    layer = [0.01] * 8
    profile = {
        "forward_s": layer,
        "backward_s": [2 * t for t in layer],
        "cpu_s": [3 * t for t in layer],
        "shared_cores": 1.0,
        "parameter_bytes": [1000] * 8,
        "activation_bytes": [10**6] * 8,
        "memory_bytes": 2**34,
        "model": "test cpu",
        "cpu_fallback": False,
    }
    specs = [LayerSpec(torch.nn.Identity)] * 8
    choice = rank({8: {"cpu": profile}}, specs, TrainConfig(pp=4, schedule="auto"))
    seconds = {c.schedule: c.step_seconds for c in choice.candidates}
    assert seconds["gpipe"] == pytest.approx(seconds["1f1b"], rel=1e-9)
    assert choice.chosen.schedule == "1f1b" and seconds["zb-h1"] > seconds["1f1b"], choice


class Projections(torch.nn.Module):
    """A block of two wide linears, only `q_proj` a LoRA target."""

    def __init__(self, width: int = 768) -> None:
        super().__init__()
        self.q_proj, self.up = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.up(torch.relu(self.q_proj(x)))


def test_profiles_time_input_and_weight_gradients_apart_and_lora_leaves_w_the_adapters():
    """The profiler splits each layer's backward as a stage does: a first layer (its input takes no
    gradient) has it all in W; later ones I and W as they take (6 and 2 simulated ms, read off a
    clock only the layers move, so the figures are exact on any machine). Under LoRA the layers
    carry adapters over a frozen base, and W computes the adapters' gradients alone: counted in
    FLOPs, W's work falls to a small fraction of a full layer's."""
    from raypipe.actors.profiler import LayerProfiler
    from raypipe.models.simulated import SimulatedClock, SimulatedCompute

    clock = SimulatedClock()
    profiler = LayerProfiler("cpu", False, clock=clock)
    layers = [LayerSpec(SimulatedCompute, 0.002, 0.006, weight_s=0.002, clock=clock) for _ in range(3)]
    x = torch.randn(4, 8)
    prof = profiler.profile(layers, 0, x, torch.randn(4, 8), torch.nn.functional.mse_loss, split=True, repeats=3)
    assert prof["input_s"] == pytest.approx([0.0, 0.006, 0.006]), prof
    assert prof["weight_s"] == pytest.approx([0.008, 0.002, 0.002]), prof
    assert prof["forward_s"] == pytest.approx([0.002] * 3) and prof["backward_s"] == pytest.approx([0.008] * 3)
    assert "input_s" not in profiler.profile(layers, 0, x, x, torch.nn.functional.mse_loss, repeats=1)

    wide = [LayerSpec(Projections)] * 2
    h = torch.randn(256, 768)
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]}
    loss = torch.nn.functional.mse_loss
    with WorkClock() as work:
        counting = LayerProfiler("cpu", False, clock=work)
        full, adapters = (counting.profile(wide, 0, h, h, loss, split=True, lora=c, repeats=1) for c in (None, lora))
    assert adapters["weight_s"][1] < 0.1 * full["weight_s"][1], (adapters["weight_s"], full["weight_s"])
    assert adapters["backward_s"][1] < full["backward_s"][1] and adapters["input_s"][1] > 0


def test_auto_picks_the_cheapest_predicted_schedule_and_runs_it(ray_session):
    """schedule="auto" on eight simulated layers (F, I and W 4 ms each): every candidate is
    predicted from the profiled layers, the start line ranks them cheapest first, and the
    cheapest is what the trainer runs. How close each candidate's measured step comes to its
    prediction is a timing claim: `benchmarks/auto_schedule.py --simulated` measures it."""
    from raypipe.models.simulated import SimulatedCompute
    from raypipe.planning.autoschedule import rank

    layers = [LayerSpec(SimulatedCompute, 0.004, 0.004, weight_s=0.004) for _ in range(8)]
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    asked, lines = config(pp=2, schedule="auto"), []
    with Trainer(layers, torch.nn.functional.mse_loss, asked, sample=(x, y), log=lines.append) as t:
        chosen = t.config
        assert lines[0] == "raypipe: profiling the layers to choose schedule=auto ..."
        assert lines[1].startswith(f"schedule=auto chose {chosen.schedule}")
        choice = rank(t.plan_report.profiled_microbatches, layers, asked)
        predicted = [c.step_seconds for c in choice.candidates if c.step_seconds is not None]
        assert len(predicted) >= 6 and choice.chosen.step_seconds == min(predicted), choice
        assert (choice.chosen.schedule, choice.chosen.microbatches) == (chosen.schedule, chosen.microbatches)
        assert torch.isfinite(torch.tensor(t.step(x, y)["loss"]))
    ranked = [line for line in lines[1].splitlines()[1:] if line.startswith("  ") and " ms" in line]
    assert len(ranked) >= 6 and ranked[0].strip().startswith(chosen.schedule)


def test_timelines_draw_weight_gradients_in_their_own_colour(tmp_path):
    from raypipe.observe.timeline import COLOURS, Timeline

    line = Timeline.planned(build_schedule("zb-h1", 3, 4), 1.0, 2.0, "zb-h1")
    kinds = {span.kind for span in line.spans}
    assert kinds == {"F", "I", "W"} and COLOURS["W"] not in (COLOURS["F"], COLOURS["I"])
    svg = line.to_svg()
    assert svg.count(f'fill="{COLOURS["W"]}"') >= 12  # one W per microbatch and stage
    assert line.makespan == pytest.approx(max(end for run in timed_run("zb-h1", 3, 4) for _, _, end in run))


def timed_run(name: str, p: int, m: int):
    from raypipe.schedules import timed

    return timed(build_schedule(name, p, m), {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})
