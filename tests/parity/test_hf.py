"""HuggingFace transformers models split across stage actors: tiny GPT-2 (its head tied to the
token embedding) and Llama (grouped-query attention, rotary embeddings) saved as transformers
saves them, then trained by raypipe against the same transformers model trained in one process
on whole batches. Every step's loss, the first step's gradients and the weights after 3
SGD-momentum steps agree (rtol 1e-5, atol 4e-5) for pp 1, 2, 3, both schedules, dp 2, and tp 2
for Llama from its own `base_model_tp_plan`; padding masks and ignored labels included."""

import pytest
import torch

from raypipe import TrainConfig, Trainer
from raypipe.models import hf

from helpers import assert_close_dicts
from hf_helpers import by_hf_name, hf_reference, lm_batch, load, run_schedules, save_tiny

pytest.importorskip("transformers")

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Both tiny models on disk, and their one-process reference runs."""
    out = {}
    for kind in ("gpt2", "llama"):
        directory = save_tiny(kind, str(tmp_path_factory.mktemp(kind)))
        out[kind] = directory, hf_reference(directory)
    return out


def check_parity(trainer, reference, names):
    ref_losses, ref_grads, ref_final = reference
    for losses, grads, final in run_schedules(trainer, trainer.state_dict()).values():
        grads = by_hf_name(grads, names)
        assert_close_dicts(grads, {n: ref_grads[n] for n in grads})
        assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
        final = by_hf_name(final, names)
        assert_close_dicts(final, {n: ref_final[n] for n in final})


CASES = [
    ("gpt2", 1, 1, 1),
    ("gpt2", 2, 1, 1),
    ("gpt2", 3, 1, 1),
    ("gpt2", 2, 2, 1),
    ("llama", 1, 2, 1),
    ("llama", 2, 1, 1),
    ("llama", 3, 1, 1),
    ("llama", 2, 1, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, pp, dp, tp", CASES, ids=[f"{k}-pp{p}-dp{d}-tp{t}" for k, p, d, t in CASES])
def test_training_matches_transformers_in_one_process(ray_session, saved, tmp_path, kind, pp, dp, tp):
    directory, reference = saved[kind]
    model = hf.from_pretrained(directory)
    config = TrainConfig(
        pp=pp, dp=dp, tp=tp, microbatches=4 // dp, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1
    )
    with Trainer(model, config=config) as t:
        check_parity(t, reference, model.exporter.names(t.specs))
        if kind == "gpt2" and pp > 1:  # the tied copies on the first and last stage stayed bit-identical
            state = t.state_dict()
            assert torch.equal(state["0.wte.weight"], state[f"{len(t.specs) - 1}.lm_head.weight"])
        if tp > 1:  # the export merges tp shards; generation runs on every tp rank with its own cache
            exported = load(str(t.save_pretrained(str(tmp_path / "out"))))
            x, _ = lm_batch(7)
            with torch.no_grad():
                torch.testing.assert_close(t.predict(x), exported(**x).logits, rtol=1e-5, atol=1e-5)
            prompt = x["input_ids"][:2, :4]
            expected = exported.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(t.generate(prompt, max_new_tokens=5), expected)


@pytest.mark.slow
def test_bf16_weights_train_through_fp32_master_copies(ray_session, saved):
    directory, _ = saved["llama"]
    ref_losses, _, ref_final = hf_reference(directory, bf16=True)
    model = hf.from_pretrained(directory, dtype="bf16")
    # a bf16 model's boundaries are bf16 already: boundary_dtype="bf16" leaves them so, and the next
    # stage computes on them in bf16 (its weights' dtype), not float32
    config = TrainConfig(pp=2, microbatches=1, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    with Trainer(model, config=config.replace(boundary_dtype="bf16")) as t:
        info = t.stage_info()
        assert {i["dtype"] for i in info} == {"bfloat16"}
        # masters: 4 bytes per weight besides the 2 it is stored in
        assert [i["optimizer_state_bytes"] for i in info] == [2 * i["parameter_bytes"] for i in info]
        metrics = [t.step(*lm_batch(k)) for k in range(3)]
        losses = [m["loss"] for m in metrics]
        # nothing float32 crossed, so boundary_dtype="auto" would have nothing to narrow on a slow link
        assert all(s["sent_bytes"] > 0 and s["fp32_sent_bytes"] == 0 for s in metrics[0]["stages"])
        final = by_hf_name(t.state_dict(), model.exporter.names(t.specs))
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for name, value in final.items():  # bit for bit: the same bf16 kernels, the same fp32 master updates
        assert value.dtype == torch.bfloat16 and torch.equal(value, ref_final[name]), name


@pytest.mark.slow
def test_zero3_shards_a_bf16_llama_read_from_its_files(ray_session, saved):
    """Weights read from safetensors in bf16, sharded over dp = 2 with fp32 slices as their masters:
    losses and weights as the bf16 one-process run, up to the order of the dp average."""
    directory, _ = saved["llama"]
    ref_losses, _, ref_final = hf_reference(directory, bf16=True)
    model = hf.from_pretrained(directory, dtype="bf16")
    config = TrainConfig(pp=2, dp=2, zero=3, microbatches=1, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    with Trainer(model, config=config) as t:
        info = t.stage_info()
        assert all(i["optimizer_state_bytes"] == 0 for i in info)  # fp32 slices are the parameters' own
        # fp32 slices (half the weights, twice the bytes) and the largest layer, not bf16 + fp32 masters (3x)
        assert all(i["memory"]["parameters"] < 2 * i["parameter_bytes"] for i in info)
        losses = [t.step(*lm_batch(k))["loss"] for k in range(3)]
        final = by_hf_name(t.state_dict(), model.exporter.names(t.specs))
    assert losses == pytest.approx(ref_losses, rel=2e-3)
    for name, value in final.items():
        assert value.dtype == torch.bfloat16, name
        torch.testing.assert_close(value.float(), ref_final[name].float(), rtol=2e-2, atol=2e-3, msg=name)
