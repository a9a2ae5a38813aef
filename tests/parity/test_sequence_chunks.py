"""Sequence chunks (`TrainConfig.sequence_chunks`) change nothing but the order: losses, gradients
and weights equal the unchunked run's (fp32, rtol 1e-5) at pp 2 and 3, k 2..8, under 1F1B, GPipe
and ZB-H1 (backwards split, or handed on early), with padding and -100 labels, on the p2p and refs
engines; for raypipe's GPT, transformers' Llama (LoRA too) and Mistral's sliding window, whose
unchunked runs match transformers in one process."""

import re

import pytest
import torch

from raypipe import ConfigError, StageError, TrainConfig, Trainer
from raypipe.core.layers import build_layers
from raypipe.driver.run.chunk_trial import CLOSER
from raypipe.models import gpt, hf

from hf_helpers import VOCAB, by_hf_name, hf_reference, lm_batch, run_schedules, save_tiny

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
LENGTH = 24  # divides into 2, 3, 4 and 8 chunks
RECOMPUTE = "recompute"  # a case run with activation checkpointing (`chunked_runs`)


def long_batch(k: int):
    """Four rows of 24 tokens: left padding on two (mask 0, label -100) and more ignored labels."""
    return lm_batch(k, size=4, length=LENGTH)


def chunked_runs(trainer, cases, data, steps=2, start=None):
    """Per case, (schedule, sequence_chunks) or (schedule, sequence_chunks, RECOMPUTE) (activation
    checkpointing: each chunk's forward runs again in its backward), from the same start (the
    trainer's weights, or `start`) with fresh optimizer state: the steps' losses, the first step's
    gradients and the final weights."""
    runs = [
        {"schedule": case[0], "sequence_chunks": case[1], "activation_checkpointing": RECOMPUTE in case}
        for case in cases
    ]
    start = start if start is not None else trainer.state_dict()
    out = run_schedules(trainer, start, steps=steps, data=data, schedules=runs)
    return {
        case: out[(run["schedule"], run["sequence_chunks"], run["activation_checkpointing"])]
        for case, run in zip(cases, runs)
    }


def assert_same_run(run, reference, atol=1e-6):
    (losses, grads, final), (ref_losses, ref_grads, ref_final) = run, reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=atol)
    assert set(grads) == set(ref_grads) and set(final) == set(ref_final)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=atol, msg=name)
    for name in ref_final:
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=atol, msg=name)


def unpadded_batch(k: int):
    """`long_batch` without its padding (the -100 labels kept): under eager attention a row whose
    mask hides every key (a left-padded one) attends to all keys alike, the later chunks' too,
    which no chunk can see; SDPA gives such a row nothing in both runs."""
    x, y = long_batch(k)
    return {"input_ids": x["input_ids"], "attention_mask": torch.ones_like(x["attention_mask"])}, y


def without_cache(x, y):
    return {**x, "use_cache": False}, y


def packed_batch(k: int):
    """Four rows of 24 tokens, each packing documents of different lengths (`position_ids` start
    again; no attention mask), each document's first label ignored."""
    g = torch.Generator().manual_seed(700 + k)
    ids = torch.randint(1, VOCAB, (4, LENGTH), generator=g)
    positions, labels = torch.zeros_like(ids), ids.clone()
    for row, lengths in enumerate([(10, 8, 6), (24,), (3, 12, 9), (5, 5, 5, 9)]):
        start = 0
        for n in lengths:
            positions[row, start : start + n] = torch.arange(n)
            labels[row, start] = -100
            start += n
    return {"input_ids": ids, "position_ids": positions}, labels


# (family, pp, config overrides, LoRA, attention, (schedule, k) cases). transformers' SDPA runs a
# chunk block by block on the CPU (`raypipe.nn.chunk_attention`; the window hides whole blocks of
# Mistral's); eager attention takes the earlier chunks' keys joined under a mask, as a GPU does.
HF_CASES = {
    "llama-pp2": ("llama", 2, {}, None, "sdpa", [("1f1b", 4), ("gpipe", 3), ("1f1b", 4, RECOMPUTE)]),
    "llama-pp3": ("llama", 3, {}, None, "sdpa", [("1f1b", 8), ("gpipe", 2), ("zb-h1", 4)]),
    "mistral-sliding-pp2": ("mistral", 2, {"sliding_window": 5}, None, "sdpa", [("1f1b", 4), ("1f1b", 3, RECOMPUTE)]),
    "llama-lora-pp2": (
        "llama",
        2,
        {},
        {"r": 4, "alpha": 8, "target_modules": "all-linear"},
        "sdpa",
        [("1f1b", 2, RECOMPUTE)],
    ),
    "llama-eager-pp2": ("llama", 2, {}, None, "eager", [("1f1b", 2), ("gpipe", 4, RECOMPUTE)]),
    "llama-eager-packed-pp2": ("llama", 2, {}, None, "eager", [("1f1b", 3)]),
    "mistral-packed-pp2": ("mistral", 2, {"sliding_window": 5}, None, "sdpa", [("1f1b", 4), ("gpipe", 3)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_transformers_model_trains_on_chunks_exactly_as_unchunked(ray_session, tmp_path, case):
    kind, pp, overrides, lora, attention, cases = HF_CASES[case]
    directory = save_tiny(kind, str(tmp_path / kind), num_hidden_layers=pp + 1, **overrides)
    model = hf.from_pretrained(directory, attn_implementation=attention)
    config = TrainConfig(pp=pp, microbatches=2, optimizer=SGD, lora=lora, cpus_per_actor=0.25, threads_per_actor=1)
    with Trainer(model, config=config) as t:
        data = packed_batch if "packed" in case else long_batch if attention == "sdpa" else unpadded_batch
        runs = chunked_runs(t, [("1f1b", 1), *cases], data)
        names = model.exporter.names(t.specs)
    if lora is None and attention == "sdpa":  # unchunked raypipe is transformers in one process (the window too)
        # without a cache, as transformers keeps packed documents apart only then (raypipe trains so)
        ref_losses, ref_grads, _ = hf_reference(directory, steps=2, data=lambda k: without_cache(*data(k)))
        unchunked = runs[("1f1b", 1)]
        torch.testing.assert_close(torch.tensor(unchunked[0]), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
        grads = by_hf_name(unchunked[1], names)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    for key in cases:
        assert_same_run(runs[key], runs[("1f1b", 1)])


def gpt_batch(k: int):
    """Four rows of 32 tokens with some targets ignored (-100), a different number per chunk."""
    g = torch.Generator().manual_seed(900 + k)
    seq = torch.randint(0, 64, (4, 33), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    y[0, 3:11] = -100
    y[2, 20:] = -100
    return x, y


@pytest.mark.slow
def test_the_gpt_trains_on_chunks_exactly_as_unchunked_at_pp2_and_pp3(ray_session, monkeypatch):
    tiny = gpt.GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=32, vocab_size=64)
    config = TrainConfig(pp=2, microbatches=2, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    with Trainer(gpt.layers(tiny), gpt.loss_fn, config) as t:
        # k 5: 7, 7, 6, 6, 6 tokens; ZB-H1: each unit's backward split, its keys' gradients in the first half
        cases = [("zb-h1", 4), ("zb-h1", 3, RECOMPUTE), ("1f1b", 4, RECOMPUTE), ("1f1b", 2), ("gpipe", 8), ("1f1b", 5)]
        start = t.state_dict()
        runs = chunked_runs(t, [("1f1b", 1), *cases], gpt_batch)
        for key in cases:
            assert_same_run(runs[key], runs[("1f1b", 1)])
        metrics = t.step(*gpt_batch(3))
        # stage 0 runs pp - 1 + k - 1 = 5 forwards ahead, then one more before each backward
        assert metrics["stages"][0]["peak_stashed_microbatches"] == 6
        t.reconfigure(measure_activations=True)
        kept = [s["peak_stashed_bytes"] for s in t.step(*gpt_batch(3))["stages"]]
        t.reconfigure(activation_checkpointing=True)  # a chunk keeps its input, keys and values
        recomputed = [s["peak_stashed_bytes"] for s in t.step(*gpt_batch(3))["stages"]]
        assert all(r < 0.6 * k for r, k in zip(recomputed, kept)), (recomputed, kept)
        # stage 1's backwards split, the input half handed on first: the keys' gradients in its first
        # half, the earlier chunks' leaves among its inputs (read at reconfigure)
        monkeypatch.setenv("RAYPIPE_EARLY_GRADIENTS", "1")
        early = chunked_runs(t, [("1f1b", 4), ("gpipe", 3, RECOMPUTE)], gpt_batch, start=start)
        monkeypatch.delenv("RAYPIPE_EARLY_GRADIENTS")
        for key in early:
            assert_same_run(early[key], runs[("1f1b", 1)])
    # pp 3 on the refs engine: the driver issues each unit's forward and backward
    config = TrainConfig(pp=3, microbatches=1, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1, engine="refs")
    with Trainer(gpt.layers(tiny), gpt.loss_fn, config) as t:
        runs = chunked_runs(t, [("1f1b", 1), ("1f1b", 4)], gpt_batch)
    assert_same_run(runs[("1f1b", 4)], runs[("1f1b", 1)])


class Attend(torch.nn.Module):
    """Attention over the whole sequence, saying nothing about chunks."""

    def forward(self, x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_a_layer_that_cannot_run_on_chunks_is_refused_at_start_naming_it(ray_session):
    from raypipe import LayerSpec

    layers = [LayerSpec(torch.nn.Embedding, 16, 8), LayerSpec(Attend), LayerSpec(torch.nn.Linear, 8, 16)]
    config = TrainConfig(pp=2, sequence_chunks=2, cpus_per_actor=0.25, threads_per_actor=1)
    with pytest.raises((ConfigError, StageError), match=r"layer 1 \(Attend, on stage1-dp0-tp0\) cannot run on"):
        Trainer(layers, lambda out, y: out.mean(), config)


@pytest.mark.slow
def test_auto_times_the_layers_on_each_chunk_count_then_measures_its_choice_against_none(ray_session):
    """One sample of 1,024 tokens through two stages: the profiler times the layers on it cut in 1,
    2, 4, 8 and 16, per unit; the bubble of the unchunked step is half of it, so a cut is planned.
    Then the planned k, its profiled neighbours (half and twice) and k = 1 take real steps on the
    sample (`chunk_trial`), the fastest is kept (the planner's where another is within `CLOSER`,
    never one slower than k = 1), and the trial leaves no trace: the weights
    are the seeded model's, and the first step (SGD with momentum: a buffer the trial left would
    change it) is the one-process model's."""
    tiny = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=1024, vocab_size=256)
    seq = torch.randint(0, 256, (1, 1025), generator=torch.Generator().manual_seed(5))
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    config = TrainConfig(pp=2, sequence_chunks="auto", optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    lines = []
    with Trainer(gpt.layers(tiny), gpt.loss_fn, config, sample=(x, y), log=lines.append) as t:
        profiled = t.plan_report.profiled_microbatches
        assert set(profiled) == {(1, k) for k in (1, 2, 4, 8, 16)}
        per_unit = [sum(profiled[(1, k)]["cpu"]["forward_s"]) for k in (1, 2, 4, 8, 16)]
        assert per_unit[1] < 0.8 * per_unit[0] and per_unit[-1] < 0.5 * per_unit[0], per_unit  # a share of it
        planned = int(re.match(r"sequence_chunks=auto chose 1f1b, m=1, sequence_chunks=(\d+):", lines[1])[1])
        assert lines[0] == "raypipe: profiling the layers to choose sequence_chunks=auto ..."
        measured = next(line for line in lines if line.startswith("sequence_chunks=auto measured on the sample"))
        timed = {int(c): [float(v) for v in ms.split(", ")] for c, ms in re.findall(r"=(\d+) ([\d, ]+) ms", measured)}
        timed[1] = [float(v) for v in re.search(r"unchunked ([\d, ]+) ms", measured)[1].split(", ")]
        assert sorted(timed) == sorted({1, planned, *(c for c in (planned // 2, 2 * planned) if 1 < c <= 16)}), measured
        k = t.config.sequence_chunks
        fastest = {c: min(ms) for c, ms in timed.items()}  # the log rounds to 1 ms
        assert fastest[k] <= fastest[1] + 1 and fastest[k] <= fastest[planned] + 1, (k, measured)
        assert k in (1, planned) or fastest[k] < (1 - CLOSER) * fastest[planned] + 1, (k, measured)  # clearly faster
        verdict = f"keeping sequence_chunks={k}" if k > 1 else "running unchunked (sequence_chunks=1)"
        assert planned > 1 and verdict in measured, (planned, k, measured)
        reference = torch.nn.Sequential(*build_layers(gpt.layers(tiny)))
        assert_same_weights(t.state_dict(), reference.state_dict())
        metrics = t.step(x, y)
        assert metrics["stages"][0]["peak_stashed_microbatches"] == k  # stage 0 holds every unit
        optimizer = torch.optim.SGD(reference.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
        loss = gpt.loss_fn(reference(x), y)
        loss.backward()
        optimizer.step()
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert_same_weights(t.state_dict(), reference.state_dict())


def assert_same_weights(state, reference):
    assert set(state) == set(reference)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
