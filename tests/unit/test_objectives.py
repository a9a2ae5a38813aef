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
