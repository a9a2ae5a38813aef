"""A GRPO run's generation batches (`TrainConfig.objective` "grpo"), made on the driver with the
trainer's own actors: G completions of each prompt generated through the pipeline (its KV cache,
seeded sampling at the objective's temperature, top-k and top-p), scored by the reward functions,
then (`grpo_batch`) the rows a step trains on, with the reference policy's per-token log-probs for
the KL term (beta > 0) and, when a generation batch takes several optimisation steps
(`num_iterations`), the policy's own from before the first of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from raypipe.core.errors import BatchError
from raypipe.data.batches import check_positions, check_token_ids, split_batch
from raypipe.driver.inference.forward import run_forward
from raypipe.driver.inference.generation import generate_on
from raypipe.driver.inference.reference import reference_kind
from raypipe.objectives.rewards import RewardFunctions
from raypipe.objectives.rollouts import check_rollout_prompts, completions_of, rollout_batch

if TYPE_CHECKING:
    from raypipe.driver.actor_group import ActorGroup


def grpo_batch(group: ActorGroup, rollout: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict]:
    """`(x, y)` of one GRPO optimisation step on the generation batch `rollout` ({"prompt_ids",
    "completion_ids", "rewards"}: `objectives.rollout_batch`) for `group` (an `ActorGroup`). With
    `num_iterations` > 1 the policy's per-token log-probs are measured at the batch's first step
    and kept in `rollout` (a dict) as "old_logps", which its next steps reuse.

    Raises:
        BatchError: the rollout's columns are missing, or its rows do not divide into dp x
            microbatches.
    """
    c, o = group.config, group.config.objective
    x, y = rollout_batch(rollout, o["num_generations"], o["scale_rewards"])
    check_token_ids(x, group.model.vocab_size)  # before any pass: no actor sees an id outside the vocabulary
    inputs, targets = split_batch(x, {"labels": y["labels"]}, c.dp * c.microbatches, 1, c.dp * c.microbatches)
    path = group.inference_path()
    if o["beta"] > 0:
        y["ref_logps"] = torch.cat(run_forward(*path, inputs, targets, c.step_timeout, reference=reference_kind(group)))
    if o["num_iterations"] > 1:
        old = rollout.get("old_logps")
        if old is None:
            old = torch.cat(run_forward(*path, inputs, targets, c.step_timeout, reference="policy"))
            if isinstance(rollout, MutableMapping):
                rollout["old_logps"] = old
        y["old_logps"] = old
    return x, y


def generate_rollout(
    group: ActorGroup, kv_cache: bool, records: Sequence[Mapping[str, object]], rewards: RewardFunctions, seed: int
) -> tuple[dict[str, object], dict[str, float]]:
    """One generation batch of the prompt `records` ([{"prompt_ids", ...other columns}]): the rollout
    {"prompt_ids", "completion_ids", "rewards"} and its figures (generation_s, scoring_s,
    generated_tokens, and each reward function's mean, `rewards/<name>/mean`). Each prompt's G
    completions are sampled from generator seed `seed`; a completion ends at the model's end-of-text
    token or at `max_completion_length`.

    Raises:
        BatchError: the records are not prompt records.
    """
    o = group.config.objective
    prompts = check_rollout_prompts(records)
    g = o["num_generations"]
    repeated = [p for p in prompts for _ in range(g)]
    width = max(map(len, repeated))
    check_positions(
        width + o["max_completion_length"],
        group.model.max_positions,
        f"the longest prompt ({width} tokens) with TrainConfig.objective's max_completion_length "
        f"({o['max_completion_length']})",
        "shorten the prompts or lower max_completion_length",
    )
    input_ids = torch.zeros((len(repeated), width), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, p in enumerate(repeated):  # left-padded, as generation numbers positions from the mask
        input_ids[r, width - len(p) :], mask[r, width - len(p) :] = torch.tensor(p), 1
    started = time.perf_counter()
    sampling = (o["max_completion_length"], o["temperature"], o["top_k"], kv_cache)
    label = f"generating {len(repeated)} completions"
    out = generate_on(group, label, input_ids, *sampling, mask, rewards.eos_token_id, seed, o["top_p"])
    generated = time.perf_counter()
    completions = completions_of(out, width, rewards.eos_token_id)
    scores, means = rewards.score([r for r in records for _ in range(g)], completions)
    timings = {
        **means,
        "generation_s": generated - started,
        "scoring_s": time.perf_counter() - generated,
        "generated_tokens": float(sum(map(len, completions))),
    }
    return {"prompt_ids": prompts, "completion_ids": completions, "rewards": scores}, timings


class GenerationBatches:
    """`fit`'s batches under GRPO: step k trains on generation batch k // num_iterations, made from
    `prompts(k // num_iterations)` (a function) or the iterable's next list of prompt records, on
    the weights as they stand when its first step comes; its generation and scoring figures join
    that step's metrics (`figures`). A batch is kept, its old-policy log-probs with it, until no
    recovery can replay its steps (`kept_from`): a recovery to a checkpoint inside a batch replays
    its steps on the completions they began with, not on new ones from the weights part-way."""

    def __init__(self, group: ActorGroup, kv_cache: bool, prompts: Callable[[int], Any] | Any) -> None:
        self.group, self.kv_cache = group, kv_cache
        o = group.config.objective
        self.rewards = RewardFunctions(o)
        self.prompts = prompts if callable(prompts) else None
        self.items = None if callable(prompts) else iter(prompts)
        self.read: list[object] = []  # an iterable's prompt lists so far (small): a replayed step asks again
        self.rollouts: dict[int, dict[str, object]] = {}  # by generation batch, from the oldest a recovery replays
        self.figures: dict[int, dict[str, float]] = {}

    def records(self, index: int) -> Any:
        """Generation batch `index`'s prompt records."""
        if self.prompts is not None:
            return self.prompts(index)
        while len(self.read) <= index:
            try:
                self.read.append(next(self.items))
            except StopIteration:
                raise BatchError(
                    f"the iterable of prompt records ended after {len(self.read)} batches; generation batch "
                    f"{index + 1} needs one more"
                ) from None
        return self.read[index]

    def __call__(self, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        started = time.perf_counter()
        index = step // self.group.config.objective["num_iterations"]
        if index not in self.rollouts:
            records = self.records(index)
            seed = (self.group.config.seed or 0) * 1_000_003 + index
            self.rollouts[index], self.figures[step] = generate_rollout(
                self.group, self.kv_cache, records, self.rewards, seed
            )
        batch = grpo_batch(self.group, self.rollouts[index])
        # what making this step's rows took (generation, scoring, the reference and old-policy passes):
        # the step's throughput counts it (`run.step.recorded`)
        self.figures.setdefault(step, {})["rows_s"] = time.perf_counter() - started
        return batch

    def kept_from(self, step: int) -> None:
        """Lets go of the generation batches of steps before `step`, which no recovery replays."""
        oldest = step // self.group.config.objective["num_iterations"]
        self.rollouts = {i: r for i, r in self.rollouts.items() if i >= oldest}
