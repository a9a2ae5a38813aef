"""What a transformers layer keeps from one step to the next, in one process (no Ray): decoder
layers' arguments (`argument_memo`), and the embedding taken without the base model's prologue
where the family's prologue adds nothing (`embedding_alone`), each bit for bit what the prologue
makes, and refused where positions or padding decide them."""

from __future__ import annotations

import pytest
import torch

from raypipe.core.layers import build_layer
from raypipe.data.sequence_units import cut_microbatch
from raypipe.models import hf
from raypipe.models.hf import argument_memo, embedding_alone, rope, skeleton
from raypipe.nn.sequence_chunks import Sequence, check_chunkable
from raypipe.transport.tree import map_tensors, tensors

from hf_helpers import VOCAB, family_config, load, save_tiny, tiny_config


@pytest.fixture(autouse=True)
def fresh():
    argument_memo.clear()
    embedding_alone._verdicts.clear()
    with torch.random.fork_rng():  # the seeds here leave later tests' random data as it was
        yield
    argument_memo.clear()
    embedding_alone._verdicts.clear()


def layers_of(config) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    model = hf.from_config(config)
    return [build_layer(spec, 0, i) for i, spec in enumerate(model.layers)], model.loss_fn


def counting_prologues(monkeypatch) -> list[int]:
    calls = [0]
    real = skeleton._prologue

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(skeleton, "_prologue", counted)
    return calls


# (family, whether its prologue hands the first layer the embedding's output unchanged)
EMBEDDINGS = [
    ("llama", True),
    ("gemma2", True),  # the sqrt(hidden) scale is inside its embedding module
    ("granite", False),  # its base model multiplies the embedding (embedding_multiplier)
    ("gpt2", None),  # token and position embeddings: never asked
]


@pytest.mark.parametrize("kind, alone", EMBEDDINGS)
def test_the_embedding_skips_the_prologue_only_where_the_family_adds_nothing(monkeypatch, kind, alone):
    config = tiny_config(kind) if kind in ("llama", "gpt2") else family_config(kind)
    embedding = layers_of(config)[0][0]
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    held = {name: getattr(embedding, name) for name in embedding.names}
    expected = skeleton.embed(embedding.config, held, {"input_ids": ids, "attention_mask": None, "position_ids": None})
    calls = counting_prologues(monkeypatch)
    first, second = embedding(ids)["hidden_states"], embedding(ids)["hidden_states"]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert calls[0] == (1 if alone else 2)  # the first call asks; a family that adds nothing is asked once
    assert list(embedding_alone._verdicts.values()) == ([] if alone is None else [alone])
    second.sum().backward()  # the short way trains the embedding as the prologue did
    assert all(p.grad is not None for p in embedding.parameters())
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)}
    embedding(padded)
    assert calls[0] == (2 if alone else 3)  # a mask takes the prologue


def test_a_decoder_layer_keeps_its_arguments_where_positions_alone_decide_them(monkeypatch):
    layers, _ = layers_of(tiny_config("llama"))
    decoder = layers[1]
    x = {"hidden_states": torch.randn(2, 10, 16), "attention_mask": None, "position_ids": torch.arange(10)[None]}
    made = decoder(x)["hidden_states"]
    calls = counting_prologues(monkeypatch)
    assert torch.equal(decoder(x)["hidden_states"], made) and calls[0] == 0
    packed = {**x, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])}  # two documents
    decoder(packed)
    decoder({**packed, "position_ids": packed["position_ids"].clone()})  # the next step's: made again
    padded = {**x, "attention_mask": torch.ones(2, 10, dtype=torch.long).index_fill_(1, torch.tensor([0]), 0)}
    decoder(padded)
    assert calls[0] == 3  # none is kept from step to step
    decoder({**x, "hidden_states": torch.randn(3, 10, 16)})  # another batch: its own entry
    assert calls[0] == 4


@pytest.mark.parametrize("kind, made", [("llama", 1), ("gemma3", 2)])
def test_a_padded_microbatch_makes_its_arguments_once_per_attention_type_as_the_whole_model_does(
    monkeypatch, kind, made
):
    """A stage's decoder layers, one after another on one padded microbatch: one prologue per
    attention type (Gemma 3's sliding and full layers: two), the outputs those of arguments made per
    layer; the next microbatch (new mask and positions) makes its own."""
    config = tiny_config(kind) if kind == "llama" else family_config(kind)
    decoders = [layer for layer in layers_of(config)[0] if hasattr(layer, "block")]
    mask = torch.ones(2, 10, dtype=torch.long).index_fill_(1, torch.tensor([0, 1]), 0)
    x = {"hidden_states": torch.randn(2, 10, 16), "attention_mask": mask, "position_ids": torch.arange(10)[None]}
    calls = counting_prologues(monkeypatch)
    out, expected = x, x["hidden_states"]
    for decoder in decoders:
        out = decoder(out)
        inputs = {"attention_mask": mask, "position_ids": x["position_ids"], "use_cache": False}
        args, kwargs = skeleton.layer_inputs(decoder.config, [decoder.index], expected, inputs)[decoder.index]
        expected = decoder.block(expected, *args, **kwargs)
        expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.equal(out["hidden_states"], expected)
    assert calls[0] == made + len(decoders)  # theirs, and the reference's one per layer
    decoders[0]({**x, "attention_mask": mask.clone()})
    assert calls[0] == made + len(decoders) + 1


def test_the_memo_keeps_within_its_budget_and_nothing_with_history(monkeypatch):
    ones = torch.ones(256)  # 1 KiB
    monkeypatch.setattr(argument_memo, "BUDGET", 2048)
    for i in range(3):
        argument_memo.put(("k", i), ((), {"t": ones.clone()}))
    assert argument_memo.get(("k", 0)) is None and argument_memo.get(("k", 2)) is not None  # oldest dropped
    argument_memo.put(("grad",), ((), {"t": torch.ones(2, requires_grad=True)}))
    assert argument_memo.get(("grad",)) is None
    with torch.inference_mode():
        made = torch.ones(2)
    argument_memo.put(("inference",), ((), {"t": made}))
    assert argument_memo.get(("inference",)) is None
    on_device = {"attention_mask": None, "position_ids": torch.arange(4, device="meta")[None]}
    assert not argument_memo.plain(on_device, 0, 4)  # an accelerator's positions are not read back
    assert argument_memo.plain({"attention_mask": None, "position_ids": torch.arange(2, 6)[None]}, 2, 6)
    from transformers import DynamicCache

    old, new = DynamicCache(), DynamicCache()
    args, kwargs = argument_memo.with_cache(((old, 1), {"past_key_values": old, "x": 2}), new)
    assert args == (new, 1) and kwargs == {"past_key_values": new, "x": 2}


def chunked_step(stages, loss_fn, x, y, k) -> tuple[list[float], list[torch.Tensor]]:
    """One step of two stages on k chunks, as a stage runs them (forwards in order, backwards in
    reverse): each chunk's part of the mean loss, and every parameter's gradient."""
    units, targets, counts = cut_microbatch(x, y, k, loss_fn)
    weights = [c / sum(counts) for c in counts]
    sequences, sent, received, losses = [Sequence(k), Sequence(k)], [], [], []
    for c, unit in enumerate(units):
        out = sequences[0].forward(c, stages[0], unit)
        sent.append(out)
        received.append(map_tensors(lambda t: t.detach().requires_grad_() if t.is_floating_point() else t, out))
        losses.append(loss_fn(sequences[1].forward(c, stages[1], received[c]), targets[c]) * weights[c])
    for c in reversed(range(k)):
        pairs = [(losses[c], torch.ones(())), *sequences[1].roots(c)]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        pairs = [(a, b.grad) for a, b in zip(tensors(sent[c]), tensors(received[c])) if b.grad is not None]
        pairs += sequences[0].roots(c)
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads = [p.grad.clone() for s in stages for p in s.parameters()]
    for s in stages:
        s.zero_grad(set_to_none=True)
    return [float(v.detach()) for v in losses], grads


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_chunks_kept_from_an_earlier_step_train_bit_for_bit_as_made_afresh(monkeypatch, kind):
    config = tiny_config(kind, **({"sliding_window": 5} if kind == "mistral" else {}))
    layers, loss_fn = layers_of(config)
    stages = [torch.nn.Sequential(*layers[:3]), torch.nn.Sequential(*layers[3:])]
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    first = chunked_step(stages, loss_fn, {"input_ids": ids}, ids.clone(), 4)
    calls = counting_prologues(monkeypatch)
    kept = chunked_step(stages, loss_fn, {"input_ids": ids}, ids.clone(), 4)
    assert calls[0] == 0  # every chunk's arguments and embedding kept
    assert kept[0] == first[0] and all(torch.equal(a, b) for a, b in zip(kept[1], first[1]))
    # documents that start again after a first chunk of one document: that chunk (kept) made no
    # documents, the later ones see it as one (`chunk_cache.packed_mask`): as unchunked, which
    # transformers keeps apart without a cache
    positions = torch.cat([torch.arange(9), torch.arange(15)]).expand(2, -1)
    packed = {"input_ids": ids, "position_ids": positions}
    losses, grads = chunked_step(stages, loss_fn, packed, ids.clone(), 4)
    whole, whole_grads = unchunked_step(stages, loss_fn, packed, ids.clone())
    torch.testing.assert_close(torch.tensor(sum(losses)), torch.tensor(whole), rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert abs(whole - sum(first[0])) > 1e-3  # the documents were kept apart


def unchunked_step(stages, loss_fn, x, y) -> tuple[float, list[torch.Tensor]]:
    loss = loss_fn(stages[1](stages[0](x)), y)
    loss.backward()
    grads = [p.grad.clone() for s in stages for p in s.parameters()]
    for s in stages:
        s.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


# rotary embeddings whose frequencies follow the length, past 16 positions (the tiny Llama's
# head is 4 wide: 2 factors; `verify` fits them to its own small model's 16)
FOLLOWING = {
    "dynamic": {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    "longrope": {
        "max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "longrope",
            "factor": 4.0,
            "short_factor": [1.0, 1.5],
            "long_factor": [3.0, 8.0],
            "original_max_position_embeddings": 16,
        },
    },
}


@pytest.mark.parametrize("kind", list(FOLLOWING))
def test_rotary_frequencies_that_follow_the_length_are_the_whole_sequences_in_chunks_and_never_kept(tmp_path, kind):
    """transformers' dynamic rotary embedding grows its frequencies to the longest sequence seen and
    keeps them for shorter ones after it; longrope takes its long factors past 16 positions here. A
    chunk, seeing only its own positions, gets the whole sequence's (its unit carries the sequence's
    end), and no length's arguments are kept from step to step: transformers' model's logits over
    four packed documents of 16 in 4 chunks (their end, not the row's), 48 tokens in 4 chunks, 24, 64
    and 24 tokens whole, and 48 in chunks again."""
    directory = save_tiny("llama", str(tmp_path), **FOLLOWING[kind])
    reference, model = load(directory).eval(), hf.from_pretrained(directory)
    stage = torch.nn.Sequential(*[build_layer(spec, 0, i) for i, spec in enumerate(model.layers)])
    check_chunkable(list(stage), "stage0", list(range(len(stage))))
    ids = torch.randint(1, VOCAB, (1, 64), generator=torch.Generator().manual_seed(3))

    def chunked(length: int, positions: torch.Tensor | None = None) -> torch.Tensor:  # two stages, as a pipeline
        x = {"input_ids": ids[:, :length], **({"position_ids": positions} if positions is not None else {})}
        units, _, _ = cut_microbatch(x, ids[:, :length], 4, model.loss_fn)
        end = length if positions is None else int(positions.max()) + 1
        assert [int(u["sequence_end"]) for u in units] == [end] * 4
        first, second, halves = Sequence(4), Sequence(4), (stage[:2], stage[2:])
        outs = [second.forward(c, halves[1], first.forward(c, halves[0], unit)) for c, unit in enumerate(units)]
        return torch.cat(outs, dim=1)

    with torch.no_grad():
        # four packed documents of 16 (the original length): frequencies of 16, not of the row's 64
        packed = torch.arange(16).repeat(4)[None]
        expected = reference(input_ids=ids, position_ids=packed, use_cache=False).logits
        torch.testing.assert_close(chunked(64, packed), expected, rtol=1e-5, atol=1e-6)
        # 24 after 64: a dynamic embedding's frequencies grown for 64; chunks of 48 before and after
        for length, cut in [(48, True), (24, False), (64, False), (24, False), (48, True)]:
            expected = reference(input_ids=ids[:, :length]).logits
            if cut:
                torch.testing.assert_close(chunked(length), expected, rtol=1e-5, atol=1e-6, msg=str(length))
            else:
                assert torch.equal(stage({"input_ids": ids[:, :length]}), expected), length
        with pytest.raises(ValueError, match=f"{kind}.*needs its sequence's end"):
            Sequence(2).forward(0, stage, {"input_ids": ids[:, :24]})  # a unit cut elsewhere
    per_type = {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "yarn"}}
    assert rope.follows_length(type("C", (), {"rope_parameters": per_type})()) is None
    assert rope.follows_length(type("C", (), {"rope_scaling": {"type": "dynamic"}})()) == "dynamic"
    assert rope.follows_length(tiny_config("llama")) is None
