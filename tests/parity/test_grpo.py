"""GRPO through the pipeline (`TrainConfig.objective` "grpo"): with the completions fixed (generation
out of the comparison), a tiny transformers Llama with LoRA trained 2 SGD-momentum steps by
`Trainer.step` equals TRL 1.16's GRPOTrainer on the same PeftModel in one process (its advantages,
reference, old policy and loss, fed through its own `rollout_func`): losses, TRL's metrics, the
gradients and the adapters. "grpo" from a new adapter at pp 2 dp 1 under the refs engine; "dapo" from a loaded non-zero
adapter (a frozen copy its reference) at pp 2 dp 2 with 2 optimisation steps on one generation
batch; "dr_grpo" on the last stage's loss alone. Then `fit` generating and scoring its own batches,
and greedy generation against transformers' `generate`."""

import pytest
import torch

from raypipe import BatchError, ConfigError, TrainConfig, Trainer
from raypipe.models import hf
from raypipe.models.hf import adapters
from raypipe.objectives import GRPOLoss, rollout_batch

from helpers import assert_close_dicts
from hf_helpers import VOCAB, load, save_tiny, small_job

pytest.importorskip("peft")
pytest.importorskip("trl")

SGD = {"name": "sgd", "lr": 0.5, "momentum": 0.9}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
G = 4
COMPARED = ("reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/region_mean")


def reward(prompts, completions, completion_ids, **_):
    """A verifiable reward of the token ids alone: the share of even ones."""
    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]


def rollout(k: int, prompts: int = 2) -> dict:
    """A generation batch: `prompts` prompts of different lengths, G completions each of 1-6 tokens
    (two of one group equal in reward, so a group's std is not trivially large), their rewards."""
    g = torch.Generator().manual_seed(900 + k)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompt_ids = [ids(2 + (i + k) % 3) for i in range(prompts)]
    completion_ids = [ids(1 + (r * 5 + k) % 6) for r in range(prompts * G)]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "rewards": reward(None, None, completion_ids)}


def trl_grpo(directory, initial, batches, objective, out):
    """TRL's GRPOTrainer on the peft model, each generation batch's completions given by its
    `rollout_func`, its `_compute_loss` stepped by SGD here: losses, metrics, gradients (last step)
    and final adapters (peft's names)."""
    from datasets import Dataset
    from peft import get_peft_model, set_peft_model_state_dict
    from trl import GRPOConfig, GRPOTrainer

    from raypipe.data.hf_tokenizer import byte_tokenizer
    from raypipe.nn.lora import peft_config

    model = get_peft_model(load(directory), peft_config(LORA))
    set_peft_model_state_dict(model, initial)
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = tokenizer.convert_ids_to_tokens(0), tokenizer.convert_ids_to_tokens(1)
    given = {}

    def fixed(prompts, trainer):
        rows = [given["prompt_ids"][int(p)] for p in prompts]
        return {"prompt_ids": rows, "completion_ids": given["completion_ids"], "logprobs": None}

    settings = {k: objective[k] for k in ("beta", "loss_type", "num_generations", "num_iterations", "epsilon")}
    args = GRPOConfig(
        output_dir=out,
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2 * G,
        max_completion_length=objective.get("max_completion_length", 512),
        bf16=False,  # TRL turns bf16 autocast on by default; the comparison is in fp32
        **settings,
    )
    prompts = Dataset.from_list([{"prompt": str(i)} for i in range(2)])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=prompts,
        processing_class=tokenizer,
        rollout_func=fixed,
    )
    trainer.current_gradient_accumulation_steps = 1
    trained = [p for n, p in trainer.model.named_parameters() if p.requires_grad and ".default." in n]
    opt = torch.optim.SGD(trained, lr=SGD["lr"], momentum=SGD["momentum"])
    trainer.model.train()
    losses, metrics = [], []
    for batch in batches:
        given.update(batch)
        inputs = trainer._generate_and_score_completions([{"prompt": str(i)} for i in range(2) for _ in range(G)])
        for _ in range(objective["num_iterations"]):
            loss = trainer._compute_loss(trainer.model, inputs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            metrics.append({m: v[-1] for m in (*COMPARED, "kl") if (v := trainer._metrics["train"][m])})
    grads = {
        k.replace(".default.", "."): p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None
    }
    state = model.state_dict()
    final = {k.replace(".default.", "."): v for k, v in state.items() if ".lora_" in k and ".ref." not in k}
    return losses, metrics, grads, final


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return save_tiny("llama", str(tmp_path_factory.mktemp("llama")))


CASES = [("grpo", False, 1, 1, "refs"), ("dapo", True, 2, 2, "p2p")]  # the second under GPipe


@pytest.mark.parametrize(
    "loss_type, loaded, dp, iterations, engine",
    CASES,
    ids=["grpo-new-adapter-dp1-refs", "dapo-loaded-adapter-dp2-2-iterations"],
)
def test_grpo_steps_through_the_pipeline_equal_trls_grpo_trainer(
    ray_session, directory, tmp_path, loss_type, loaded, dp, iterations, engine
):
    objective = {
        "name": "grpo",
        "beta": 0.04,
        "loss_type": loss_type,
        "num_generations": G,
        "num_iterations": iterations,
        "epsilon": 0.2,
    }
    config = TrainConfig(
        pp=2,
        dp=dp,
        microbatches=2,
        engine=engine,
        schedule="1f1b" if engine == "refs" else "gpipe",
        optimizer=SGD,
        lora=LORA,
        objective=objective,
        cpus_per_actor=0.25,
        threads_per_actor=1,
    )
    model = hf.from_pretrained(directory)
    batches = [rollout(0), rollout(1)][: 2 // iterations]
    with Trainer(model, config=config) as t:
        start = t.state_dict()
        initial = {k: v for k, v in start.items() if ".lora_" in k}
        if loaded:  # an adapter trained before: its B matrices are not zero, its copy the reference
            g = torch.Generator().manual_seed(5)
            initial = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in initial.items()}
            t.load_state_dict({**start, **initial})
        names = adapters.peft_names(list(initial), model.exporter.prefixes(t.specs))
        ref_losses, ref_metrics, ref_grads, ref_final = trl_grpo(
            directory, {names[k]: v for k, v in initial.items()}, batches, objective, str(tmp_path / "trl")
        )
        steps = [t.step(batch) for batch in batches for _ in range(iterations)]
        grads = t.gradients()
        final = t.state_dict()
        with pytest.raises(BatchError, match="2 prompts with num_generations=4 need 8 completions"):
            t.step({**rollout(2), "completion_ids": rollout(2)["completion_ids"][:7]})
    torch.testing.assert_close(torch.tensor([s["loss"] for s in steps]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for got, want in zip(steps, ref_metrics):
        torch.testing.assert_close(
            torch.tensor([got[m] for m in COMPARED]), torch.tensor([want[m] for m in COMPARED]), rtol=1e-5, atol=1e-7
        )
        # the KL estimate exp(d) - d - 1 of per-token gaps d ~ 1e-3 cancels in float32: ~1e-6 apart
        torch.testing.assert_close(got["kl"], want["kl"], rtol=1e-3, atol=3e-6)
    assert_close_dicts({names[k]: final[k] for k in initial}, ref_final)
    assert_close_dicts({names[k]: grads[k] for k in initial}, {names[k]: ref_grads[names[k]] for k in initial})
    assert all(torch.equal(final[k], v) for k, v in start.items() if k not in initial)  # the base untouched


def test_dr_grpos_loss_and_gradients_equal_trls(directory, tmp_path):
    """The last stage's loss alone, on a whole model in one process: "dr_grpo" divides by rows x
    max_completion_length, as TRL does."""
    from peft import get_peft_model, get_peft_model_state_dict

    from raypipe.nn.lora import peft_config

    objective = {"beta": 0.0, "loss_type": "dr_grpo", "num_generations": G, "num_iterations": 1, "epsilon": 0.2}
    objective["max_completion_length"] = 16
    torch.manual_seed(0)
    model = get_peft_model(load(directory), peft_config(LORA))
    initial = {k: v + 0.1 * torch.randn_like(v) for k, v in get_peft_model_state_dict(model).items()}
    losses, _, ref_grads, _ = trl_grpo(directory, initial, [rollout(3)], objective, str(tmp_path / "trl"))
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, initial)
    x, y = rollout_batch(rollout(3), G)
    loss = GRPOLoss(0.0, "dr_grpo", max_completion_length=16)(model(**x).logits, y)
    loss.backward()
    torch.testing.assert_close(loss.item(), losses[0], rtol=1e-5, atol=1e-7)
    grads = {k.replace(".default.", "."): p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert_close_dicts(grads, {k: ref_grads[k] for k in grads})


def test_fit_generates_scores_and_trains_and_greedy_generation_is_transformers(ray_session, directory):
    """`fit` on prompt records, the whole model trained (no LoRA: each stage keeps a frozen copy of
    its starting weights for the KL term): G completions of each prompt sampled through the
    pipeline, scored by the reward function named by its import path, trained on (2 optimisation
    steps per generation batch); the step's metrics carry the generation's figures. Greedy
    generation equals transformers'."""
    objective = {
        "name": "grpo",
        "num_generations": G,
        "max_completion_length": 6,
        "temperature": 0.9,
        "top_p": 0.95,
        "num_iterations": 2,
        "beta": 0.04,
        "reward_funcs": ["test_grpo:reward"],
    }
    config = TrainConfig(
        pp=2, microbatches=2, optimizer=SGD, objective=objective, cpus_per_actor=0.25, threads_per_actor=1
    )
    prompts = lambda k: [{"prompt_ids": rollout(k)["prompt_ids"][i]} for i in range(2)]  # noqa: E731
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        ids = torch.tensor(rollout(0)["prompt_ids"][:1])
        greedy = t.generate(ids, max_new_tokens=5)
        start = t.state_dict()
        steps = t.fit(prompts, steps=4, log=lambda _: None)
        final = t.state_dict()
        # a prompt that leaves no room for max_completion_length in the model's 32 positions is refused naming both
        with pytest.raises(
            BatchError, match=r"longest prompt \(30 tokens\) with .*max_completion_length \(6\).*past the model's 32"
        ):
            t.fit(lambda k: [{"prompt_ids": [1] * 30}] * 2, steps=5, log=lambda _: None)
        assert t.step_count == 4 and all(torch.equal(t.state_dict()[k], v) for k, v in final.items())
    expected = load(directory).generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(greedy, expected)
    # every step's throughput counts what making its rows took (generation, scoring, passes), and says so
    assert all(m["rows_s"] > 0 and m["tokens_per_s"] < m["train_tokens_per_s"] for m in steps)
    generated = steps[0::2]  # each generation batch's first step carries its figures
    assert all("generation_s" not in m for m in steps[1::2])
    for first, second in zip(steps[0::2], steps[1::2]):
        assert first["reward"] == second["reward"]  # one generation batch, two steps
        assert first["generation_s"] > 0 and first["scoring_s"] >= 0 and 0 <= first["reward"] <= 1
        assert 1 <= first["completions/mean_length"] <= 6
        assert first["generated_tokens"] == first["completions/mean_length"] * 2 * G
        assert first["kl"] >= 0 and second["kl"] > 0  # the second step's policy has moved from the reference
    assert generated[0]["reward"] != generated[1]["reward"]  # another batch of prompts, other samples
    assert sum(not torch.equal(final[k], v) for k, v in start.items()) > len(start) // 2


def test_a_recovery_inside_a_generation_batch_replays_it_on_the_completions_it_began_with(
    ray_session, directory, tmp_path
):
    """Issue 74.7 and 74.2: two optimisation steps per generation batch, a checkpoint every 3 steps
    (inside batch 1), the last stage killed while batch 2 is scored, so its reference pass finds it
    dead. `fit` recovers (a death in a pass ended it before), restores step 3 and replays step 4 on
    batch 1's own completions and old-policy log-probs: the same loss, where a batch generated again
    from the weights part-way gave another."""
    import ray

    doomed = []

    def reward_that_kills(prompts, completions, completion_ids, **_):
        if doomed:
            ray.kill(doomed.pop())
        return reward(prompts, completions, completion_ids)

    objective = {
        "name": "grpo",
        "num_generations": G,
        "max_completion_length": 4,
        "num_iterations": 2,
        "beta": 0.04,
        "reward_funcs": [reward_that_kills],
    }
    config = TrainConfig(
        pp=2,
        microbatches=2,
        optimizer=SGD,
        lora=LORA,
        objective=objective,
        cpus_per_actor=0.25,
        threads_per_actor=1,
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=3,
        max_restarts=1,
    )
    killed = []
    with Trainer(hf.from_pretrained(directory), config=config) as t:

        def prompts(k):
            if k == 2 and not killed:  # killed once batch 2 is generated, while it is scored
                killed.append(t.group.actors[-1])
                doomed.append(killed[0])
            return [{"prompt_ids": rollout(k)["prompt_ids"][i]} for i in range(2)]

        steps = t.fit(prompts, steps=6, log=lambda _: None)
        assert killed and t.restarts == 1
    losses: dict[int, list[float]] = {}
    for m in steps:
        losses.setdefault(m["step"], []).append(m["loss"])
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and len(losses[4]) == 2, losses  # step 4 ran, then was replayed
    assert losses[4][0] == losses[4][1]


def test_grpo_settings_are_checked_with_what_to_give():
    with pytest.raises(ConfigError, match="loss_type must be one of 'grpo', 'dr_grpo', 'dapo'"):
        TrainConfig(objective={"name": "grpo", "loss_type": "ppo"})
    with pytest.raises(ConfigError, match="num_generations must be an int >= 2"):
        TrainConfig(objective={"name": "grpo", "num_generations": 1})
    with pytest.raises(ConfigError, match="one number per reward function"):
        TrainConfig(objective={"name": "grpo", "reward_funcs": [reward], "reward_weights": [1, 2]})
    full = TrainConfig(objective={"name": "grpo"}).objective  # TRL's defaults; no LoRA needed
    assert full["loss_type"] == "dapo" and full["num_generations"] == 8 and full["beta"] == 0.0


def test_the_grpo_example_job_generates_scores_and_prints_the_reward(ray_session, tmp_path):
    from raypipe.job import JobConfig, run

    base = save_tiny("llama", str(tmp_path / "base"), vocab_size=256)
    small = small_job(
        base, "job.log_every=1", "objective.max_completion_length=8", f"job.save_adapter={tmp_path / 'adapter'}"
    )
    lines = []
    summary = run(JobConfig.from_yaml("examples/configs/grpo.yaml", small), log=lines.append)
    assert len(summary["losses"]) == 4 and len(summary["rewards"]) == 4 and summary["val_first"] is None
    assert sum(" | reward " in line and " | generated in " in line for line in lines) == 4, lines
    assert all(0 <= r <= 1 for r in summary["rewards"])
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    with pytest.raises(ConfigError, match="'prompts' with objective {name: grpo}"):
        run(JobConfig.from_yaml("examples/configs/grpo.yaml", [*small, "data.source=pairs"]), log=lines.append)
