"""Every family transformers declares a pipeline plan for splits with no code of its own
(`raypipe.models.hf.skeleton`): tiny Qwen3, Qwen3-MoE (routing loss on), Gemma 3 (sliding and
full layers), Gemma 2, Phi-3, OLMo 2, GPT-NeoX, Granite and DeepSeek-V3 (latent attention, shared
experts), saved as transformers saves them, trained by raypipe against the same model trained in
one process: every step's loss, the first step's gradients and the weights after 3 SGD-momentum
steps agree, padding and ignored labels included; the export loads back into transformers and
gives raypipe's logits. Each family once at pp = 2 or 3 (Qwen3-MoE against the same four
microbatches, since transformers computes its routing loss per forward call)."""

import pytest
import torch

from raypipe import ConfigError, TrainConfig, Trainer
from raypipe.models import hf

from helpers import assert_close_dicts
from hf_helpers import (
    by_hf_name,
    family_config,
    hf_microbatch_reference,
    hf_reference,
    lm_batch,
    load,
    run_schedules,
    save_family,
)

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
FAMILIES = [
    ("qwen3", 2),
    ("qwen3_moe", 3),
    ("gemma3", 3),
    ("gemma2", 2),
    ("phi3", 2),
    ("olmo2", 3),
    ("gpt_neox", 2),
    ("granite", 2),
    ("deepseek_v3", 3),
]


CASES = [(kind, pp, 1) for kind, pp in FAMILIES] + [("qwen3", 1, 2), ("gemma2", 1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("kind, pp, tp", CASES, ids=[f"{k}-pp{p}-tp{t}" for k, p, t in CASES])
def test_a_family_from_its_pipeline_plan_trains_like_transformers(ray_session, tmp_path, kind, pp, tp):
    """tp = 2 splits from the model's own `base_model_tp_plan`: Qwen3's per-head q and k norms,
    replicated, have their gradients summed over the ranks, as the plan says."""
    directory = save_family(kind, str(tmp_path / "model"))
    # transformers computes a routing loss per forward call: the reference takes the same microbatches
    moe = kind == "qwen3_moe"
    ref_losses, ref_grads, ref_final = hf_microbatch_reference(directory, 4) if moe else hf_reference(directory)
    model = hf.from_pretrained(directory)
    config = TrainConfig(pp=pp, tp=tp, microbatches=4, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    # Granite's split is the planner's, from its layers timed on transformers' dict boundaries
    profiled = {"partition": "profile"} if kind == "granite" else {}
    with Trainer(model, config=config.replace(**profiled), sample=lm_batch(0) if profiled else None) as t:
        assert (t.plan_report is not None) == bool(profiled)
        names = model.exporter.names(t.specs)
        ((losses, grads, final),) = run_schedules(t, t.state_dict(), schedules=("1f1b",)).values()
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=4e-5)
        grads = by_hf_name(grads, names)
        assert set(grads) == set(ref_grads), sorted(set(ref_grads) ^ set(grads))
        assert_close_dicts(grads, ref_grads)
        final = by_hf_name(final, names)
        assert_close_dicts(final, {n: ref_final[n] for n in final})
        exported = load(str(t.save_pretrained(str(tmp_path / "out")))).eval()
        x, _ = lm_batch(7)
        with torch.no_grad():
            torch.testing.assert_close(t.predict(x), exported(**x).logits, rtol=1e-5, atol=1e-5)


def test_a_model_object_trains_without_a_directory_and_module_split_points_to_it(ray_session):
    from transformers import AutoModelForCausalLM

    from raypipe.models import module

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3"))
    with pytest.raises(ConfigError, match=r"Qwen3ForCausalLM is a transformers model: pass it to Trainer\(model"):
        module.split(model)
    config = TrainConfig(pp=2, microbatches=2, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)
    with Trainer(model, config=config) as t:
        x, labels = lm_batch(0)
        with torch.no_grad():
            expected = model(**x, labels=labels)
        assert t.evaluate(x, labels) == pytest.approx(expected.loss.item(), rel=1e-5)
        torch.testing.assert_close(t.predict(x), expected.logits, rtol=1e-5, atol=1e-5)
        assert_close_dicts(t.state_dict(keys="transformers"), model.state_dict(), rtol=0, atol=0)


def test_a_split_that_differs_from_transformers_is_refused_naming_where(monkeypatch, tmp_path):
    from raypipe.models.hf import argument_memo, skeleton, verify

    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verify, "_verdicts", {})
    real = skeleton.layer_inputs

    def shifted(config, indices, hidden, inputs):  # a composition that gets one layer's positions wrong
        inputs = {**inputs, "position_ids": inputs["position_ids"] * (2 if 1 in indices else 1)}
        return real(config, indices, hidden, inputs)

    monkeypatch.setattr(skeleton, "layer_inputs", shifted)
    # each layer makes its own arguments (raypipe makes them once per attention type, or keeps
    # them from a step before): the check must still name the one layer whose are wrong
    monkeypatch.setattr(argument_memo, "get", lambda key: None)
    monkeypatch.setattr(
        argument_memo,
        "_shared",
        lambda config, index, hidden, inputs: skeleton.layer_inputs(
            config, [index], hidden, {**inputs, "use_cache": False}
        )[index],
    )
    with pytest.raises(ConfigError, match=r"split of qwen3 .* decoder layer 1's output differs.*refused"):
        hf.from_config(family_config("qwen3"))
    monkeypatch.setattr(skeleton, "layer_inputs", real)
    assert "decoder layer 1" in (tmp_path / "hf-verdicts.json").read_text()  # kept for this machine
    monkeypatch.setenv("RAYPIPE_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setattr(verify, "_verdicts", {})
    assert hf.from_config(family_config("qwen3")).config.model_type == "qwen3"


def test_the_families_table_in_the_docs_is_current():
    import transformers

    from raypipe.models.hf import table

    version, types = table.written_table(table.DOCS.read_text())
    assert version == transformers.__version__, "run: python -m raypipe.models.hf.table"
    assert types == table.model_types(), "run: python -m raypipe.models.hf.table"
