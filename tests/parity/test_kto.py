"""KTO through the pipeline, the fourth objective (`raypipe/objectives/kto.py`, one module): a tiny
transformers Llama with LoRA at pp 2 with 2 microbatches, 3 SGD-momentum steps of unpaired examples,
whose losses, TRL's metrics (the KL estimate among them) and adapters equal TRL 1.16's KTOTrainer's
(its collator, its mismatched KL pairs, its reference: the starting adapter) on the same PeftModel
in one process. What every objective inherits, with no KTO code outside its module: a checkpoint
that resumes the run exactly, and a stage lost in the middle of a step's reference pass, which
`fit` recovers from (restarted, restored, replayed) to the same losses."""

import pytest
import ray
import torch

from raypipe import BatchError, ConfigError, TrainConfig, Trainer
from raypipe.models import hf
from raypipe.models.hf import adapters

from helpers import assert_close_dicts, tensorboard_run
from hf_helpers import VOCAB, assert_equal_to_trl, load, save_tiny, trl_sgd_steps

pytest.importorskip("peft")

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
METRICS = ("kl", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected", "rewards/margins")
STEPS = 3


def examples(k: int, n: int = 8) -> list[dict]:
    """n unpaired example records of random token ids, two in three desirable."""
    g = torch.Generator().manual_seed(900 + k)
    ids = lambda length: torch.randint(1, VOCAB, (length,), generator=g).tolist()  # noqa: E731
    return [
        {"prompt_ids": ids(2 + i % 3), "completion_ids": ids(1 + (i + k) % 4), "label": (i + k) % 3 != 0}
        for i in range(n)
    ]


def trl_kto(directory, initial, steps, out):
    """TRL's KTOTrainer on the peft model in one process, its loss stepped by SGD here: losses, its
    metrics, the final adapters (peft's names). Its collator makes the rows and the mismatched KL
    rows from each example's `KL_completion_ids` (the completion before it, cycled, as TRL's
    dataset preparation adds them)."""
    from datasets import Dataset
    from peft import get_peft_model, set_peft_model_state_dict
    from trl import KTOConfig, KTOTrainer

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.nn.lora import peft_config

    model = get_peft_model(load(directory), peft_config(LORA))
    set_peft_model_state_dict(model, initial)
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0), tokenizer.convert_ids_to_tokens(1)
    args = KTOConfig(
        output_dir=out, beta=0.1, report_to=[], use_cpu=True, max_length=None, bf16=False, per_device_train_batch_size=8
    )
    text = Dataset.from_list(
        [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}]
    )
    trainer = KTOTrainer(model=model, args=args, train_dataset=text, processing_class=tokenizer)
    trained = [p for n, p in trainer.model.named_parameters() if p.requires_grad and ".default." in n]
    batches = [examples(k) for k in range(steps)]
    for batch in batches:
        completions = [e["completion_ids"] for e in batch]
        for e, mismatched in zip(batch, completions[-1:] + completions[:-1]):
            e["KL_completion_ids"] = mismatched
    losses, metrics = trl_sgd_steps(trainer, trained, batches, METRICS, SGD)
    state = model.state_dict()
    return (
        losses,
        metrics,
        {k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k and ".ref." not in k},
    )


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("llama")))


def test_kto_through_the_pipeline_equals_trls_kto_trainer_and_resumes_and_recovers(ray_session, directory, tmp_path):
    config = TrainConfig(
        pp=2,
        microbatches=2,
        optimizer=SGD,
        lora=LORA,
        objective={"name": "kto", "beta": 0.1},
        cpus_per_actor=0.25,
        threads_per_actor=1,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=1,
        max_restarts=1,
        log_dir=str(tmp_path / "tb"),
    )
    model = hf.from_pretrained(directory)
    with Trainer(model, config=config) as t:
        start = t.state_dict()
        initial = {k: v for k, v in start.items() if ".lora_" in k}
        names = adapters.peft_names(list(initial), model.exporter.prefixes(t.specs))
        steps = [t.step(examples(k)) for k in range(STEPS)]
        final = t.state_dict()
        # ids outside the vocabulary and rows past the model's positions are refused before any pass runs
        bad, long = examples(0), examples(0)
        bad[0], long[0] = {**bad[0], "prompt_ids": [VOCAB + 3]}, {**long[0], "prompt_ids": [1] * 40}
        with pytest.raises(BatchError, match=rf"= {VOCAB + 3} is not a token id of the model's vocabulary of {VOCAB}"):
            t.step(bad)
        with pytest.raises(
            BatchError, match=r"the longest row \(prompt and completion\) takes \d+ positions, past the model's 32"
        ):
            t.step(long)
        assert t.step_count == STEPS and all(torch.equal(t.state_dict()[k], final[k]) for k in initial)
        # resumed from step 2's checkpoint, step 3 again is the same step
        t.load(str(tmp_path / "ck" / "step-00000002"), log=lambda _: None)
        again = t.step(examples(2))
        assert again["loss"] == steps[2]["loss"] and all(torch.equal(t.state_dict()[k], final[k]) for k in initial)
        # a stage lost while step 2's reference pass runs: fit recovers, restores step 1 and replays
        t.load(str(tmp_path / "ck" / "step-00000001"), log=lambda _: None)
        killed = []

        def batches(k):
            if k == 1 and not killed:
                killed.append(t.group.actors[-1])
                ray.kill(killed[0])
            return examples(k)

        lines = []
        replayed = t.fit(batches, STEPS, log=lines.append)
        assert killed and t.restarts == 1, lines
        assert [s["step"] for s in replayed] == [2, 3]
        assert [s["loss"] for s in replayed] == pytest.approx([s["loss"] for s in steps[1:]], rel=1e-6)
    # every metric the objective reports reaches the loggers under TRL's names (read by TensorBoard's own reader)
    events = tensorboard_run(str(tmp_path / "tb"))
    for m in METRICS:  # the replayed steps logged again purge the first ones: the same values
        logged = {e.step: e.value for e in events.Scalars(f"train/{m}")}
        assert [logged[k] for k in (1, 2, 3)] == pytest.approx([s[m] for s in steps], rel=1e-5, abs=1e-7), m
    ref_losses, ref_metrics, ref_final = trl_kto(
        directory, {names[k]: v for k, v in initial.items()}, STEPS, str(tmp_path / "trl")
    )
    assert_equal_to_trl(steps, ref_losses, ref_metrics, METRICS)
    assert_close_dicts({names[k]: final[k] for k in initial}, ref_final)
    assert all(torch.equal(final[k], v) for k, v in start.items() if k not in initial)  # the base untouched


def test_kto_settings_and_records_are_checked_with_what_to_give():
    from raypipe.objectives.kto import KTO, unpaired

    assert TrainConfig(objective={"name": "kto"}, lora=LORA).objective == {
        "name": "kto",
        "beta": 0.1,
        "loss_type": "kto",
        "desirable_weight": 1.0,
        "undesirable_weight": 1.0,
    }
    with pytest.raises(ConfigError, match="loss_type must be one of 'kto', 'apo_zero_unpaired'"):
        TrainConfig(objective={"name": "kto", "loss_type": "sigmoid"})
    with pytest.raises(ConfigError, match="desirable_weight must be a number > 0"):
        TrainConfig(objective={"name": "kto", "desirable_weight": 0})
    with pytest.raises(ConfigError, match=r"give None or one of .*'kto'"):
        TrainConfig(objective={"name": "ktoo"})
    pair = {"prompt_ids": [5], "chosen_ids": [6, 7], "rejected_ids": [8]}
    assert unpaired([pair, {**pair, "prompt_ids": [9]}]) == [  # TRL's order: every chosen, then every rejected
        {"prompt_ids": [5], "completion_ids": [6, 7], "label": True},
        {"prompt_ids": [9], "completion_ids": [6, 7], "label": True},
        {"prompt_ids": [5], "completion_ids": [8], "label": False},
        {"prompt_ids": [9], "completion_ids": [8], "label": False},
    ]
    with pytest.raises(BatchError, match="example 1 lacks label"):
        unpaired(
            [{"prompt_ids": [1], "completion_ids": [2], "label": True}, {"prompt_ids": [1], "completion_ids": [2]}]
        )
    rows = KTO(TrainConfig(objective={"name": "kto"}).objective).rows(examples(0, n=3))
    assert rows.x["input_ids"].shape[0] == 3 and set(rows.extra) == {"mismatched"}
    # the mismatched rows pair each prompt with the completion before it, cycled (TRL's KL pairs)
    first = examples(0, n=3)
    assert rows.extra["mismatched"][0]["input_ids"][0].tolist()[
        : len(first[0]["prompt_ids"]) + len(first[2]["completion_ids"])
    ] == (first[0]["prompt_ids"] + first[2]["completion_ids"])


def test_the_kto_example_job_trains_on_the_stdlib_pairs_unpaired(ray_session, tmp_path):
    from raypipe.job import JobConfig, run

    from hf_helpers import small_job

    base = save_tiny("llama", str(tmp_path / "base"), vocab_size=256)
    lines = []
    summary = run(
        JobConfig.from_yaml("examples/configs/kto.yaml", small_job(base, "job.log_every=1")), log=lines.append
    )
    assert len(summary["losses"]) == 4 and all(loss > 0 for loss in summary["losses"])
    assert sum(" | margin " in line and " | kl " in line for line in lines) == 4, lines
