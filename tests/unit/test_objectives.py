"""The pieces of a GRPO step that need no Ray: sampling's top-k/top-p against transformers' own
warpers, a generation batch made into rows and advantages, and reward functions' answers checked."""

import pytest
import torch

from raypipe import BatchError, ConfigError
from raypipe.nn.sampling import pick
from raypipe.objectives.rewards import RewardFunctions
from raypipe.objectives.rollouts import completions_of, group_advantages, rollout_batch


@pytest.mark.parametrize("top_k, top_p", [(None, 0.9), (5, 0.5), (None, 0.3)])
def test_sampling_keeps_the_tokens_transformers_warpers_keep(top_k, top_p):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    warpers = [TemperatureLogitsWarper(0.7)] + ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p)]
    allowed = torch.isfinite(LogitsProcessorList(warpers)(None, logits.clone()))
    g = torch.Generator().manual_seed(1)
    drawn = torch.stack([pick(logits, 0.7, top_k, g, top_p) for _ in range(300)], dim=1)
    assert all(bool(allowed[r, drawn[r]].all()) for r in range(6))  # nothing outside the nucleus
    assert all(
        set(drawn[r].tolist()) == set(allowed[r].nonzero().flatten().tolist())
        for r in range(6)
        if allowed[r].sum() <= 3
    )
    # and each kept token is drawn as often as its share of the nucleus says (within 5 standard errors)
    draws = 4000
    kept = torch.softmax((logits / 0.7).masked_fill(~allowed, float("-inf")), dim=-1)
    drawn = pick(logits.repeat_interleave(draws, dim=0), 0.7, top_k, g, top_p).view(6, draws)
    counts = torch.stack([torch.bincount(row, minlength=40) for row in drawn]).double() / draws
    assert bool(((counts - kept).abs() <= 5 * (kept * (1 - kept) / draws).sqrt() + 1e-9).all())


def test_a_generation_batch_becomes_rows_with_group_advantages():
    rollout = {"prompt_ids": [[5, 6], [7]], "completion_ids": [[1], [2, 3], [4], [9, 9, 9]], "rewards": [1, 0, 2, 2]}
    x, y = rollout_batch(rollout, 2)
    assert x["input_ids"].tolist() == [[5, 6, 1, 0], [5, 6, 2, 3], [7, 4, 0, 0], [7, 9, 9, 9]]
    assert y["labels"].tolist()[1] == [-100, -100, 2, 3] and x["attention_mask"].tolist()[2] == [1, 1, 0, 0]
    assert torch.allclose(y["advantages"], torch.tensor([0.7071, -0.7071, 0.0, 0.0]), atol=1e-4)
    assert y["zero_std"].tolist() == [False, False, True, True]
    advantages, _ = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, "none")
    assert advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert completions_of(torch.tensor([[0, 5, 1, 7, 7], [3, 5, 2, 4, 6]]), 2, eos_token_id=7) == [[1, 7], [2, 4, 6]]
    with pytest.raises(BatchError, match="need 4 completions"):
        rollout_batch({**rollout, "completion_ids": [[1]]}, 2)


def test_reward_functions_are_weighed_and_their_answers_checked():
    def mean_length(completion_ids, **_):
        return sum(map(len, completion_ids)) / len(completion_ids)

    with pytest.raises(BatchError, match="reward function mean_length returned float: give one float per completion"):
        RewardFunctions({"reward_funcs": [mean_length], "reward_weights": None}).score([{"prompt_ids": [1]}], [[2]])

    def lengths(prompts, completions, completion_ids, answer, **_):
        return [len(c) + a for c, a in zip(completion_ids, answer)]

    def bonus(completions, **_):
        return [0.5] * len(completions)

    rewards = RewardFunctions({"reward_funcs": [lengths, bonus], "reward_weights": [1.0, 2.0]})
    records = [{"prompt_ids": [1], "answer": 10}, {"prompt_ids": [1], "answer": 20}]
    assert rewards.score(records, [[2, 3], [4]]) == (
        [13.0, 22.0],
        {"rewards/lengths/mean": 16.5, "rewards/bonus/mean": 0.5},
    )
    with pytest.raises(ConfigError, match="cannot be imported"):
        RewardFunctions({"reward_funcs": ["math:no_such_function"], "reward_weights": None})


def test_rewards_take_trls_conventions_and_refuse_what_would_poison_a_step():
    """Issue 74, items 5 and 9: a reward function may abstain with None and answer with a numpy
    array, as TRL allows; a NaN or inf reward, an empty prompt, every function abstaining, and a
    record column named like the call's own keywords are refused naming what to fix."""
    import numpy as np

    def only_long(completion_ids, **_):  # abstains for short completions
        return [float(len(c)) if len(c) > 1 else None for c in completion_ids]

    def ones(completions, **_):
        return np.ones(len(completions))

    rewards = RewardFunctions({"reward_funcs": [only_long, ones], "reward_weights": None})
    assert rewards.score([{"prompt_ids": [1]}] * 2, [[2, 3], [4]]) == (
        [3.0, 1.0],
        {"rewards/only_long/mean": 2.0, "rewards/ones/mean": 1.0},
    )
    with pytest.raises(BatchError, match="every reward function gave None for completion 1"):
        RewardFunctions({"reward_funcs": [only_long], "reward_weights": None}).score(
            [{"prompt_ids": [1]}] * 2, [[2, 3], [4]]
        )
    with pytest.raises(BatchError, match="column 'completion_ids'.*rename that column"):
        rewards.score([{"prompt_ids": [1], "completion_ids": [5]}], [[2]])
    rollout = {"prompt_ids": [[5, 6]], "completion_ids": [[1], [2]], "rewards": [1.0, float("nan")]}
    with pytest.raises(BatchError, match="reward 1 is nan: give finite rewards"):
        rollout_batch(rollout, 2)
    with pytest.raises(BatchError, match="prompt 0's prompt_ids is empty"):
        rollout_batch({**rollout, "prompt_ids": [[]], "rewards": [1.0, 0.0]}, 2)


def test_a_reference_copy_loaded_at_another_split_keeps_zero_started_layers_at_zero():
    """Issue 74.6: a stage whose adapters started at zero saves no copy; loading found nothing and
    returned an empty copy, so that stage's reference became the adapters being trained. Now a stage
    with nothing saved takes the adapters off, and one mixing saved and unsaved layers sets the
    unsaved layers' B to zero for the pass; a copy naming a tensor the stage lacks is refused."""
    from torch import nn

    from raypipe.objectives.reference import ReferencePolicy, load_reference

    def layer():
        block = nn.Module()
        block.lora_A, block.lora_B = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        return block

    module = nn.ModuleDict({"0": layer(), "1": layer()})
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert load_reference([4, 5], None, saved={}).adapters is None  # nothing saved here: adapters off
    copy = {"1.lora_A.weight": torch.full((2, 2), 3.0), "1.lora_B.weight": torch.full((2, 2), 4.0)}
    with ReferencePolicy(copy, zeroed=("0.",)).applied(module):
        assert torch.equal(module["0"].lora_B.weight, torch.zeros(2, 2))  # started at zero
        assert torch.equal(module["0"].lora_A.weight, trained["0.lora_A.weight"])  # A is read through B = 0
        assert torch.equal(module["1"].lora_B.weight, torch.full((2, 2), 4.0))
    assert all(torch.equal(v, trained[k]) for k, v in module.state_dict().items())  # its own weights back
    with pytest.raises(KeyError, match="holds \\['7.lora_B.weight'\\], which this stage does not"):
        with ReferencePolicy({"7.lora_B.weight": torch.zeros(2, 2)}).applied(module):
            pass
