"""Sequence chunks without Ray: the Seq1F1B order, how a microbatch is cut into units and how
they weigh in the loss, the cut's refusals, and the layers that may run on chunks."""

import pytest
import torch
from torch import nn

from raypipe import ConfigError, TrainConfig
from raypipe.core.errors import BatchError
from raypipe.data.batches import prepare
from raypipe.data.sequence_units import sequence_units
from raypipe.models import gpt
from raypipe.models.hf.loss import CausalLMLoss
from raypipe.nn import sequence_chunks
from raypipe.nn.sequence_chunks import Sequence, check_chunkable
from raypipe.schedules import BACKWARD, FORWARD, INPUT_GRAD, WEIGHT_GRAD, build_schedule, timed


def step_time(schedule, k):
    """The step's span with a sample's forward taking 1 per stage and its backward 2, cut in k."""
    return max(end for actor in timed(schedule, {"F": 1.0 / k, "B": 2.0 / k}) for _, _, end in actor)


def test_1f1b_runs_a_microbatchs_chunks_forward_in_order_and_backward_in_reverse():
    schedule = build_schedule("1f1b", 2, 2, sequence_chunks=3)  # units: microbatch 0 = 0,1,2; 1 = 3,4,5
    for actions in schedule:
        forwards = [a.microbatch for a in actions if a.kind == FORWARD]
        backwards = [a.microbatch for a in actions if a.kind == BACKWARD]
        assert forwards == [0, 1, 2, 3, 4, 5] and backwards == [2, 1, 0, 5, 4, 3]
    last = [(a.kind, a.microbatch) for a in schedule[-1]]
    assert last[:4] == [(FORWARD, 0), (FORWARD, 1), (FORWARD, 2), (BACKWARD, 2)]  # k - 1 more forwards first
    gpipe = build_schedule("gpipe", 3, 2, sequence_chunks=4)
    assert [a.microbatch for a in gpipe[0] if a.kind == BACKWARD] == list(reversed(range(8)))
    # one sample over two stages: the bubble shrinks with the chunks (equal forward, double backward)
    spans = [step_time(build_schedule("1f1b", 2, 1, sequence_chunks=k), k) for k in (1, 2, 4, 8)]
    assert spans == sorted(spans, reverse=True) and spans[0] / spans[2] == pytest.approx(6 / 3.75)
    zb = build_schedule("zb-h1", 3, 1, sequence_chunks=3)  # I in reverse chunk order, each W after its I
    assert [(a.kind, a.microbatch) for a in zb[0] if a.kind != FORWARD] == [
        (kind, c) for c in (2, 1, 0) for kind in (INPUT_GRAD, WEIGHT_GRAD)
    ]
    assert [a.microbatch for a in zb[2] if a.kind == INPUT_GRAD] == [2, 1, 0]
    with pytest.raises(Exception, match="'zb-v' does not run sequence chunks"):
        build_schedule("zb-v", 2, 2, sequence_chunks=2)


def test_units_cut_inputs_and_targets_along_the_sequence_and_weigh_by_counted_tokens():
    ids = torch.arange(2 * 10).view(2, 10)
    mask = torch.ones(2, 10, dtype=torch.long)
    labels = ids.clone()
    labels[0, :6] = -100  # the first chunk of sample 0 counts almost nothing
    batch = prepare({"input_ids": ids, "attention_mask": mask}, labels, 1, 2, CausalLMLoss(32))
    units = sequence_units(batch, 2, CausalLMLoss(32))
    assert len(units.inputs[0]) == 4
    first, second = units.inputs[0][0], units.inputs[0][1]
    assert torch.equal(first["input_ids"], ids[:1, :5]) and torch.equal(second["input_ids"], ids[:1, 5:])
    # transformers' loss shifts labels inside: a chunk's targets reach one token into the next chunk
    assert torch.equal(units.targets[0][0], labels[:1, :6]) and torch.equal(units.targets[0][1], labels[:1, 5:])
    counts = [CausalLMLoss.count(t) for t in units.targets[0]]
    assert counts == [0, 4, 5, 4]  # labels 1..5 | 6..9 for sample 0, all 9 of sample 1
    whole = batch.weights[0]
    assert units.weights[0] == pytest.approx([0.0, whole[0] * 2, whole[1] * 2 * 5 / 9, whole[1] * 2 * 4 / 9])
    # raypipe's GPT: targets already shifted, -100 ignored by its cross-entropy
    x, y = torch.randint(0, 9, (2, 8)), torch.randint(0, 9, (2, 8))
    y[1, 4:] = -100
    gpt_units = sequence_units(prepare(x, y, 1, 1, gpt.loss_fn), 4, gpt.loss_fn)
    assert [t.shape for t in gpt_units.targets[0]] == [(2, 2)] * 4
    assert gpt_units.weights[0] == pytest.approx([4 * 4 / 12, 4 * 4 / 12, 4 * 2 / 12, 4 * 2 / 12])


def test_the_cut_is_refused_where_there_is_no_sequence_or_too_short_a_one():
    with pytest.raises(BatchError, match=r"first tensor has shape \(4, 6\)"):
        sequence_units(prepare(torch.randn(4, 6), torch.randn(4, 3), 1, 1, None), 2, None)
    with pytest.raises(BatchError, match="sequences of 3 tokens, fewer than sequence_chunks=4"):
        sequence_units(
            prepare(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 1, 1, None), 4, None
        )


def test_settings_that_cannot_run_on_chunks_are_refused_naming_the_field():
    assert TrainConfig(pp=2, sequence_chunks=4).sequence_chunks == 4
    assert TrainConfig(pp=2, schedule="zb-h1", sequence_chunks=2).sequence_chunks == 2
    with pytest.raises(ConfigError, match="schedule 'zb-v' does not run sequence chunks"):
        TrainConfig(pp=2, schedule="zb-v", sequence_chunks=2)
    assert TrainConfig(pp=2, sequence_chunks=2, activation_checkpointing=True).activation_checkpointing
    with pytest.raises(ConfigError, match="not with compile=True"):
        TrainConfig(pp=2, sequence_chunks=2, compile=True)
    with pytest.raises(ConfigError, match="an objective.s loss .TrainConfig.objective. is over whole sequences"):
        TrainConfig(pp=2, sequence_chunks=2, objective={"name": "dpo"}, lora={"r": 2, "target_modules": "all-linear"})
    with pytest.raises(ConfigError, match="sequence_chunks"):
        TrainConfig(sequence_chunks=0)


def test_auto_chunks_need_a_sample_and_the_split_and_are_chosen_only_at_start():
    from raypipe import LayerSpec
    from raypipe.config import check_reconfigurable
    from raypipe.planning.partition import first_plan

    assert TrainConfig(pp=2, schedule="auto", sequence_chunks="auto").sequence_chunks == "auto"
    with pytest.raises(ConfigError, match='give a whole number >= 1 \\(1: not cut\\) or "auto"'):
        TrainConfig(pp=2, sequence_chunks="four")
    with pytest.raises(ConfigError, match="leave shard_plan unset"):
        TrainConfig(pp=2, sequence_chunks="auto", shard_plan=[[0, 1], [1, 2]])
    assert TrainConfig(pp=2, schedule="zb-h1", sequence_chunks="auto").sequence_chunks == "auto"
    with pytest.raises(ConfigError, match="schedule 'zb-v' does not run sequence chunks"):
        TrainConfig(pp=2, schedule="zb-v", sequence_chunks="auto")
    with pytest.raises(ConfigError, match="sequence_chunks='auto' needs a sample batch"):
        first_plan([LayerSpec(nn.Linear, 2, 2)] * 2, TrainConfig(pp=2, sequence_chunks="auto"), False)
    with pytest.raises(ConfigError, match="sequence_chunks='auto' is chosen when a Trainer starts"):
        check_reconfigurable({"sequence_chunks": "auto"})


class Attend(nn.Module):
    """Attention over whole sequences, with no word on chunks."""

    def forward(self, x):
        return nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_layers_that_do_not_declare_chunks_are_refused_naming_them():
    check_chunkable(
        [nn.Embedding(9, 4), nn.Linear(4, 4), nn.GELU(), gpt.Head(gpt.GPTConfig(n_layer=1))], "a", [0, 1, 2, 3]
    )
    with pytest.raises(ConfigError, match=r"layer 5 \(Attend, on stage1-dp0-tp0\) cannot run on sequence chunks"):
        check_chunkable([nn.Linear(4, 4), Attend()], "stage1-dp0-tp0", [4, 5])
    moe = gpt.GPTConfig(n_layer=1, num_experts=2, top_k=1)
    with pytest.raises(ConfigError, match="MoEBlock.*says it cannot"):
        check_chunkable([gpt.MoEBlock(moe)], "a", [1])
    # `sequence_chunks="auto"`'s profiler answers why instead of failing the start
    from raypipe import LayerSpec
    from raypipe.actors.profiler import LayerProfiler

    units = [torch.randn(1, 4, moe.n_embd) for _ in range(2)]
    specs = [LayerSpec(nn.Linear, moe.n_embd, moe.n_embd), LayerSpec(gpt.MoEBlock, moe)]
    answer = LayerProfiler("cpu", False).profile(specs, 0, units, [None, None], None, sequence_chunks=2)
    assert "layer 1 (MoEBlock, on the cpu profiler) cannot run on sequence chunks" in answer["refused"]


def test_recomputed_chunks_give_the_whole_sequences_gradients_and_keep_their_keys_once():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=12, vocab_size=20)
    model = nn.Sequential(gpt.Embedding(cfg), gpt.Block(cfg), gpt.Block(cfg)).double()
    ids = torch.randint(0, 20, (2, 12))
    model(ids).square().sum().backward()
    whole = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    replays = []  # per block forward: was it activation checkpointing's recomputation?
    model[1].register_forward_hook(lambda *_: replays.append(sequence_chunks.current().replay))
    sequence = Sequence(3)
    outs = [sequence.forward(c, model, ids[:, 4 * c : 4 * c + 4], recompute=True) for c in range(3)]
    for c in reversed(range(3)):
        pairs = [(outs[c].square().sum(), torch.tensor(1.0, dtype=torch.float64)), *sequence.roots(c)]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if c:  # what the chunk made is freed, not kept again by its recomputation
            assert all(c not in kv.made and c not in kv.leaves for kv in sequence.open[(None, 0)].layers.values())
    assert replays == [False] * 3 + [True] * 3 and not sequence.open
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[name], rtol=1e-10, atol=1e-12, msg=name)


def test_auto_predicts_each_chunk_count_from_its_own_profiles_and_runs_the_fastest():
    """Per-unit profiles as the profiler makes them (a sample cut in k: each layer's forward 8/k ms
    and backward twice that, plus 0.5 ms a unit for k > 1): the unchunked step and the two-chunk
    one are their 1F1B timelines plus the planner's fixed costs; the cost per unit makes the
    fastest count an inner one, neither 1 nor 16."""
    from raypipe import LayerSpec
    from raypipe.planning.autoschedule import ACTION_OVERHEAD_S, STEP_OVERHEAD_S, rank

    def profile(k):
        forward = 0.004 / k + (0.0005 if k > 1 else 0.0)
        return {
            "cpu": {
                "forward_s": [forward] * 4,
                "backward_s": [2 * forward] * 4,
                "parameter_bytes": [1000] * 4,
                "activation_bytes": [10**6 / k] * 4,
                "memory_bytes": 2**34,
                "model": "test cpu",
                "cpu_fallback": False,
            }
        }

    profiled = {(1, k): profile(k) for k in (1, 2, 4, 8, 16)}
    choice = rank(profiled, [LayerSpec(nn.Identity)] * 4, TrainConfig(pp=2, sequence_chunks="auto"))
    seconds = {(c.schedule, c.sequence_chunks): c.step_seconds for c in choice.candidates}
    fixed = 2 * STEP_OVERHEAD_S
    # unchunked, stage by stage: F 8 ms, F 8, B 16, B 16; two chunks (F 5 ms, B 10 a unit a stage):
    # stage 0's second backward ends at 5 + 5 + 5 + 10 + 10 + 10 = 45 ms
    assert seconds[("1f1b", 1)] == pytest.approx(0.048 + 2 * ACTION_OVERHEAD_S + fixed)
    assert seconds[("1f1b", 2)] == pytest.approx(0.045 + 4 * ACTION_OVERHEAD_S + fixed)
    assert {k for _, k in seconds} == {1, 2, 4, 8, 16} and {s for s, _ in seconds} == {"1f1b"}
    best = min(seconds, key=seconds.get)
    assert (choice.chosen.schedule, choice.chosen.sequence_chunks) == best and best[1] not in (1, 16), seconds
    assert str(choice).startswith(f"sequence_chunks=auto chose 1f1b, m=1, sequence_chunks={best[1]}")
    # ZB-H1 on units, from their split halves as the profiler times them (`input_s`, `weight_s`)
    for profiles in profiled.values():
        profiles["cpu"].update(
            input_s=[f / 2 for f in profiles["cpu"]["backward_s"]], weight_s=profiles["cpu"]["backward_s"]
        )
    zb = rank(profiled, [LayerSpec(nn.Identity)] * 4, TrainConfig(pp=2, schedule="zb-h1", sequence_chunks="auto"))
    assert {(c.schedule, c.sequence_chunks) for c in zb.candidates} == {("zb-h1", k) for k in (1, 2, 4, 8, 16)}
    # layers that cannot run on chunks (the profiler's `refused`): the sequence stays whole, and the log says why
    refused = "TrainConfig.sequence_chunks: layer 1 (X) cannot run. Use sequence_chunks=1."
    for k in (2, 4, 8, 16):
        profiled[(1, k)]["cpu"]["refused"] = refused
    whole = rank(profiled, [LayerSpec(nn.Identity)] * 4, TrainConfig(pp=2, sequence_chunks="auto"))
    assert whole.chosen.sequence_chunks == 1
    assert "\n  1f1b, m=1, sequence_chunks=2: layer 1 (X) cannot run\n" in str(whole)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_transformers_layers_on_chunks_give_the_whole_sequences_logits_and_gradients(kind, monkeypatch):
    """In float64, block by block: a Llama under an attention mask that hides nothing takes the
    plain causal plan without reading transformers' mask; a Mistral whose window (5) is shorter
    than the sequence so far reads it (the window hides keys)."""
    from raypipe.core.layers import build_layer
    from raypipe.data.sequence_units import cut_microbatch
    from raypipe.models import hf
    from raypipe.nn import chunk_attention

    from hf_helpers import VOCAB, tiny_config

    config = tiny_config(kind, num_hidden_layers=2, **({"sliding_window": 5} if kind == "mistral" else {}))
    model = hf.from_config(config, attn_implementation="sdpa", verify=False)
    layers = nn.Sequential(*[build_layer(spec, 0, i) for i, spec in enumerate(model.layers)]).double()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    whole = layers(x)
    whole.square().sum().backward()
    expected = {name: p.grad.clone() for name, p in layers.named_parameters()}
    layers.zero_grad()
    plans, reading = [], chunk_attention.block_plan
    monkeypatch.setattr(chunk_attention, "block_plan", lambda *a: plans.append(1) or reading(*a))
    units, _, _ = cut_microbatch(x, ids, 3, model.loss_fn)
    sequence = Sequence(3)
    outs = [sequence.forward(c, layers, unit) for c, unit in enumerate(units)]
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, rtol=1e-10, atol=1e-10)
    for c in reversed(range(3)):
        pairs = [(outs[c].square().sum(), torch.tensor(1.0, dtype=torch.float64)), *sequence.roots(c)]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for name, p in layers.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)
    assert (len(plans) > 0) == (kind == "mistral"), plans  # chunks 1 and 2 end past the window


def test_the_profiler_times_each_units_backward_split_for_zb_h1():
    """In this process: a GPT's layers on one sample cut in 3, each unit's backward split as a stage
    splits it, per unit. The embedding's input (token ids) takes no gradient, so its backward is all
    weight half; a block's has both halves."""
    from raypipe.actors.profiler import LayerProfiler
    from raypipe.data.sequence_units import cut_microbatch

    from helpers import WorkClock

    cfg = gpt.GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=12, vocab_size=20)
    x, y = torch.randint(0, 20, (2, 12)), torch.randint(0, 20, (2, 12))
    units, targets, _ = cut_microbatch(x, y, 3, gpt.loss_fn)
    with WorkClock() as work:  # work counted, not timed: exact on a busy machine
        got = LayerProfiler("cpu", False, clock=work).profile(
            gpt.layers(cfg), 0, units, targets, gpt.loss_fn, sequence_chunks=3, split=True, warmup=0, repeats=1
        )
    assert len(got["input_s"]) == len(got["weight_s"]) == 3 and got["sequence_chunks"] == 3
    # the embedding's input half computes nothing; every later layer's halves both do
    assert got["input_s"][0] == 0 and min(got["input_s"][1:] + got["weight_s"][1:]) > 0


def test_the_trial_keeps_the_fastest_step_and_k_1_unless_a_cut_beats_it():
    """`chunk_trial.Trial`: the chunk count with the fastest timed step stays; a tie with or a
    loss to k = 1 falls back to 1, so "auto" never runs slower than not cutting (as far as measured),
    and a neighbour of the planner's k that ran faster by more than `CLOSER` replaces it. The counts timed are the
    planner's, its profiled neighbours (half and twice) and 1."""
    from raypipe.driver.run.chunk_trial import Trial, counts_to_time

    faster = Trial(4, {4: [0.20, 0.50], 1: [0.40, 0.41]})
    assert faster.kept == 4 and str(faster).endswith(
        "200, 500 ms, unchunked 400, 410 ms a step; keeping sequence_chunks=4"
    )
    assert Trial(4, {4: [0.30, 0.31], 1: [0.25, 0.26]}).kept == 1
    neighbour = Trial(4, {4: [0.30, 0.31], 2: [0.35, 0.36], 8: [0.26, 0.27], 1: [0.40, 0.40]})
    assert neighbour.kept == 8 and str(neighbour) == (
        "sequence_chunks=auto measured on the sample: sequence_chunks=4 300, 310 ms, sequence_chunks=2 350, 360 ms, "
        "sequence_chunks=8 260, 270 ms, unchunked 400, 400 ms a step; keeping sequence_chunks=8 (the planner's 4 "
        "measured slower)"
    )
    profiled = {(1, k): {} for k in (1, 2, 4, 8, 16)}
    assert counts_to_time(4, profiled) == [4, 2, 8, 1]
    assert counts_to_time(2, profiled) == [2, 4, 1] and counts_to_time(16, profiled) == [16, 8, 1]
    assert counts_to_time(8, {(1, k): {} for k in (1, 2, 4, 8)}) == [8, 4, 1]  # 16 not profiled (too few tokens)
    assert counts_to_time(8, None) == [8, 1]
    spike = Trial(8, {8: [0.397, 0.638], 4: [0.453, 0.477], 16: [0.473, 0.674], 1: [0.618, 0.601]})
    assert spike.kept == 8  # one step slowed by the machine does not hand the run to k 4 (measured, 10 x 80)
    tie = Trial(8, {8: [0.25, 0.25], 1: [0.25, 0.25]})
    assert tie.kept == 1 and str(tie).endswith("running unchunked (sequence_chunks=1)")
    # a neighbour faster by less than `CLOSER` is within what two steps tell: the planner's stays
    # (measured, 4 x 64: k 8's median step came out 18 % slower than k 4's)
    close = Trial(4, {4: [0.130, 0.160], 2: [0.130, 0.147], 8: [0.149, 0.129], 1: [0.254, 0.174]})
    assert close.kept == 4 and str(close).endswith(
        "keeping sequence_chunks=4 (the planner's; 8 faster by less than 5%, within what two steps tell)"
    )
    assert Trial(4, {4: [0.30, 0.31], 8: [0.20, 0.29], 1: [0.25, 0.26]}).kept == 8  # k 1 beats the planner's only
