"""DPO through the pipeline (`TrainConfig.objective`): a tiny transformers Llama with LoRA, its
pairs' losses, TRL's six metrics and the adapters after 5 SGD-momentum steps (3 by `step`, 2 by
`fit`) equal TRL 1.16's DPOTrainer's (its loss, collator and reference: a frozen copy of the
starting adapter) on the same PeftModel in one process, at pp 2 with 2 microbatches: sigmoid from
a new adapter at dp 1 under ZB-H1 (split backwards), its last 2 steps resumed from a checkpoint at
pp 1 reading a Ray Dataset of the pairs (the reference is still the adapters off); IPO from a
loaded non-zero one at dp 2 over a 4-bit base (QLoRA), whose checkpoint resumes DPO with that
reference (the loaded adapter's copy is in it). Full fine-tuning against TRL's reference model;
the pair data of DPO jobs; the example job."""

import re

import pytest
import torch

from raypipe import BatchError, ConfigError, TrainConfig, Trainer
from raypipe.models import hf
from raypipe.models.hf import adapters
from raypipe.objectives import METRICS

from helpers import assert_close_dicts
from hf_helpers import VOCAB, assert_equal_to_trl, load, save_tiny, small_job, trl_sgd_steps

pytest.importorskip("peft")

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


def pairs(k: int, n: int = 4) -> list[dict]:
    """n pair records of random token ids, prompts and completions of different lengths."""
    g = torch.Generator().manual_seed(700 + k)
    ids = lambda length: torch.randint(1, VOCAB, (length,), generator=g).tolist()  # noqa: E731
    return [
        {"prompt_ids": ids(2 + i % 3), "chosen_ids": ids(1 + (i + k) % 4), "rejected_ids": ids(2 + i % 2)}
        for i in range(n)
    ]


def trl_dpo(directory, initial, steps, beta, loss_type, out, bits=None):
    """TRL's DPOTrainer on the peft model in one process, its loss stepped by SGD here: losses, its
    metrics, the final adapters (peft's names). Given a PeftModel, TRL keeps a frozen copy of the
    starting adapter ("ref") as the reference policy; its collator makes the rows. `initial` None:
    the whole model trains, and TRL loads a second copy of it as the reference model. TRL's configs
    turn bf16 autocast on by default (on its reference model here); the comparison is in fp32."""
    from datasets import Dataset
    from peft import get_peft_model, set_peft_model_state_dict
    from trl import DPOConfig, DPOTrainer

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.nn.lora import peft_config, quantize

    base = load(directory)
    for layer in base.model.layers if bits else ():  # QLoRA: the same quantized base as raypipe's stages
        quantize(layer, bits)
    model = base if initial is None else get_peft_model(base, peft_config(LORA))
    if initial is not None:
        set_peft_model_state_dict(model, initial)
    tokenizer = byte_tokenizer()  # TRL wants a pad and an end token; pad 0 as raypipe pads
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0), tokenizer.convert_ids_to_tokens(1)
    args = DPOConfig(
        output_dir=out, beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True, max_length=None, bf16=False
    )
    text = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])  # unused: the steps are ours
    trainer = DPOTrainer(model=model, args=args, train_dataset=text, processing_class=tokenizer)
    trained = [
        p for n, p in trainer.model.named_parameters() if p.requires_grad and (initial is None or ".default." in n)
    ]
    losses, metrics = trl_sgd_steps(trainer, trained, [pairs(k) for k in range(steps)], METRICS, SGD)
    state = model.state_dict()
    if initial is None:
        return losses, metrics, state
    return (
        losses,
        metrics,
        {k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k and ".ref." not in k},
    )


def peft_adapter(directory, state, out):
    """`state` (peft's names) saved as peft saves an adapter, where `Trainer.load_adapter` reads it."""
    from peft import get_peft_model, set_peft_model_state_dict

    from raypipe.nn.lora import peft_config

    model = get_peft_model(load(directory), peft_config(LORA))
    set_peft_model_state_dict(model, state)
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("llama")))


CASES = [("sigmoid", False, 1, None, "zb-h1"), ("ipo", True, 2, "nf4", "1f1b")]


@pytest.mark.parametrize(
    "loss_type, loaded, dp, bits, schedule", CASES, ids=["sigmoid-new-adapter-dp1", "ipo-loaded-adapter-dp2-qlora"]
)
def test_dpo_through_the_pipeline_equals_trls_dpo_trainer(
    ray_session, directory, tmp_path, loss_type, loaded, dp, bits, schedule
):
    beta = 0.1 if loss_type == "sigmoid" else 0.5
    model = hf.from_pretrained(directory)
    config = TrainConfig(
        pp=2,
        dp=dp,
        microbatches=2,
        schedule=schedule,
        optimizer=SGD,
        lora=LORA,
        objective={"name": "dpo", "beta": beta, "loss_type": loss_type},
        quantize=bits,
        cpus_per_actor=0.25,
        threads_per_actor=1,
    )
    with Trainer(model, config=config) as t:
        start = t.state_dict()
        initial = {k: v for k, v in start.items() if ".lora_" in k}
        names = adapters.peft_names(list(initial), model.exporter.prefixes(t.specs))
        if loaded:  # an adapter trained before (an SFT one, say, in peft's format): its B matrices are not zero
            g = torch.Generator().manual_seed(3)
            initial = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in initial.items()}
            t.load_adapter(peft_adapter(directory, {names[k]: v for k, v in initial.items()}, tmp_path / "sft"))
        ref_losses, ref_metrics, ref_final = trl_dpo(
            directory, {names[k]: v for k, v in initial.items()}, 5, beta, loss_type, str(tmp_path / "trl"), bits
        )
        steps = [t.step(pairs(k)) for k in range(3)]
        with pytest.raises(BatchError, match=f"3 pairs do not divide into dp x microbatches = {dp} x 2"):
            t.step(pairs(0, n=3))
        saved = t.save(str(tmp_path / "ckpt"))
        if loaded:  # steps 4 and 5 by fit, the next one queued meanwhile
            steps += t.fit(pairs, steps=5, log=lambda _: None)
            final = t.state_dict()
            t.load(str(saved), log=lambda _: None)  # its reference, the loaded adapter, comes back with it
            again = t.fit(pairs, steps=5, log=lambda _: None)
            assert [s["loss"] for s in again] == [s["loss"] for s in steps[3:]]
            assert all(torch.equal(t.state_dict()[k], final[k]) for k in initial)
    if not loaded:  # resumed at pp 1, the reference still the adapters off, not the checkpoint's adapters
        import ray.data

        with Trainer(hf.from_pretrained(directory), config=config.replace(pp=1, microbatches=2)) as resumed:
            resumed.load(str(saved), log=lambda _: None)
            dataset = ray.data.from_items([p for k in range(5) for p in pairs(k)])  # step k's pairs are rows 4k..4k+3
            steps += resumed.fit(dataset, steps=5, log=lambda _: None, batch_size=4)  # resumed at 3: rows 12 on
            final = {**start, **resumed.state_dict()}
    assert_equal_to_trl(steps, ref_losses, ref_metrics, METRICS)
    assert_close_dicts({names[k]: final[k] for k in initial}, ref_final)
    assert all(torch.equal(final[k], v) for k, v in start.items() if k not in initial)  # the base untouched


def test_dpo_without_lora_keeps_a_frozen_copy_as_reference_and_equals_trls(ray_session, directory, tmp_path):
    """Full fine-tuning by DPO: each stage keeps a frozen copy of its starting weights as the
    reference (TRL loads a second model); 3 steps' losses, metrics and every weight equal TRL's."""
    config = TrainConfig(
        pp=2,
        microbatches=2,
        optimizer=SGD,
        objective={"name": "dpo", "beta": 0.1},
        cpus_per_actor=0.25,
        threads_per_actor=1,
    )
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        steps = [t.step(pairs(k)) for k in range(3)]
        final = t.state_dict(keys="transformers")
    ref_losses, ref_metrics, ref_final = trl_dpo(directory, None, 3, 0.1, "sigmoid", str(tmp_path / "trl"))
    assert_equal_to_trl(steps, ref_losses, ref_metrics, METRICS)
    assert_close_dicts(final, {k: v for k, v in ref_final.items() if k in final})


def test_dpo_settings_are_checked_with_what_to_give():
    from raypipe.driver.actor_group import reference_after_load

    # a loaded adapter's copy is in checkpoints at tp 1 and ep 1; where it is not, the next step says so
    assert reference_after_load({"reference": "frozen_copy", "reference_saved": True}) == "frozen_copy"
    assert reference_after_load({"reference": "frozen_copy", "reference_saved": False}) == "not_saved"
    assert reference_after_load({"reference": "adapters_off"}) == "adapters_off"
    with pytest.raises(ConfigError, match="loss_type must be one of 'sigmoid', 'hinge', 'ipo'"):
        TrainConfig(objective={"name": "dpo", "loss_type": "kto"}, lora=LORA)
    assert TrainConfig(objective={"name": "dpo"}).objective["beta"] == 0.1  # without LoRA: a frozen copy
    with pytest.raises(ConfigError, match="a pass on the driver first"):
        TrainConfig(objective={"name": "dpo"}, lora=LORA, actor_steps=4)
    with pytest.raises(ConfigError, match="gamma are not DPO settings"):
        TrainConfig(objective={"name": "dpo", "gamma": 1}, lora=LORA)
    assert TrainConfig(objective={"name": "dpo"}, lora=LORA).objective == {
        "name": "dpo",
        "beta": 0.1,
        "loss_type": "sigmoid",
    }


def test_preference_records_are_tokenized_into_trls_columns(tmp_path):
    """TRL's text and conversational records become prompt, chosen and rejected token ids (each
    completion ended by the tokenizer's end-of-sequence token), rows fit the block; JSONL is read;
    the stdlib pairs reject the docstring's words shuffled."""
    import json

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.data.preference import PreferenceDataset, stdlib_pairs
    from raypipe.data.sft import read_jsonl

    tokenizer = byte_tokenizer()
    records = [
        {"prompt": "Q: 2+2=", "chosen": "4", "rejected": "5"},
        {
            "prompt": [{"role": "user", "content": "name?"}],
            "chosen": [{"role": "assistant", "content": "raypipe"}],
            "rejected": [{"role": "assistant", "content": "no"}],
        },
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = PreferenceDataset.from_records(read_jsonl(path, pairs=True), tokenizer, block_size=12)
    first, second = data.pairs
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    assert first == {
        "prompt_ids": tokenizer.encode("Q: 2+2=", add_special_tokens=False)[-6:],
        "chosen_ids": tokenizer.encode("4", add_special_tokens=False) + eos,
        "rejected_ids": tokenizer.encode("5", add_special_tokens=False) + eos,
    }
    assert all(len(p["prompt_ids"]) + len(p[c]) <= 12 for p in data.pairs for c in ("chosen_ids", "rejected_ids"))
    assert second["chosen_ids"][:7] == tokenizer.encode("raypipe", add_special_tokens=False)[: 12 - 6]
    assert len(data.batch(3, 5, seed=1)) == 5 and data.batch(3, 5, seed=1) == data.batch(3, 5, seed=1)
    with pytest.raises(ConfigError, match="lacks rejected"):
        PreferenceDataset.from_records([{"prompt": "a", "chosen": "b"}], tokenizer, 12)
    stdlib = stdlib_pairs(limit=50, max_bytes=300_000)
    assert len(stdlib) > 10 and all(p["chosen"] != p["rejected"] for p in stdlib)
    assert all(sorted(p["chosen"].split(" ")) == sorted(p["rejected"].split(" ")) for p in stdlib)


def test_the_dpo_example_job_trains_on_stdlib_pairs_and_prints_the_reward_margin(ray_session, tmp_path):
    from raypipe.job import JobConfig, run

    base = save_tiny("llama", str(tmp_path / "base"), vocab_size=256)
    small = small_job(base, "job.log_every=3", f"job.save_adapter={tmp_path / 'adapter'}")
    lines = []
    summary = run(JobConfig.from_yaml("examples/configs/dpo.yaml", small), log=lines.append)
    assert len(summary["losses"]) == 4 and len(summary["margins"]) == 4
    steps = {int(line[5:9]): line for line in lines if " | margin " in line}
    assert sorted(steps) == [1, 3, 4], lines  # the first step, every third, the last
    # a line's margin and accuracy are the means of the steps since the line before, as TRL logs them
    assert steps[3].endswith(" (means of 2 steps)") and not steps[4].endswith("steps)"), lines
    margin = float(re.search(r"\| margin (-?\d+\.\d+)", steps[3]).group(1))
    assert margin == pytest.approx(sum(summary["margins"][1:3]) / 2, abs=1e-3)
    assert summary["val_first"] is None  # pairs report rewards, not a validation loss
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    with pytest.raises(ConfigError, match="do not go together"):
        run(JobConfig.from_yaml("examples/configs/dpo.yaml", [*small, "objective=null"]), log=lines.append)
