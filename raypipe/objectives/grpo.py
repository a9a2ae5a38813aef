"""Group relative policy optimisation (GRPO) as TRL 1.16's `GRPOTrainer` defines it, computed on the
last stage.

A generation batch holds G completions of each prompt, scored by reward functions; a completion's
advantage is its reward against its group's (`rollouts.group_advantages`). Each row is a prompt and
one completion; the target carries the labels (the completion's tokens; the prompt and padding
-100), the row's advantage, and per completion token the reference policy's log-probabilities (for
the KL term, when beta > 0) and the policy's own from before the generation batch's first
optimisation step (when it takes several: `num_iterations`). The per-token loss is the clipped
policy ratio times the advantage plus beta times the KL estimate, with TRL's importance-weighted
KL; how tokens are averaged is the loss type's: "grpo" per sequence then over sequences, "dr_grpo"
over rows x `max_completion_length`, "dapo" over every completion token of the batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from raypipe.objectives.base import IGNORE, LogProbPass, Objective, Rows, invalid_setting, register

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
)
TOKEN_MEANS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def token_logps(
    output: Any, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per position, the log-probability of the next labelled token under the logits divided by
    `temperature` (as TRL scores completions), in float32: `(logps, mask, entropies)`, each
    (rows, sequence - 1); `mask` marks the completion tokens, `entropies` (with `entropy`) is the
    predicted distribution's."""
    logits = output[0] if isinstance(output, tuple) else output
    labels = labels.to(logits.device)
    shifted = labels[:, 1:]
    mask = shifted != IGNORE
    logps = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = torch.gather(logps, 2, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropies = -(logps.exp() * logps).sum(-1).detach() if entropy else None
    return picked * mask, mask, entropies


class GRPOLoss:
    """`loss_fn` of a GRPO run: `GRPOLoss(...)(output, {"labels", "advantages", "rewards", ...})`,
    TRL's loss over the microbatch's completions. `count` is what the loss type averages over (rows,
    or completion tokens for "dapo"), so the step's loss is that mean over the whole batch; the
    microbatch's metric sums go to the step's report (`take_metrics`); `reference(output, target)`
    gives the rows' per-token log-probs in a forward-only pass."""

    def __init__(
        self,
        beta: float = 0.0,
        loss_type: str = "dapo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        max_completion_length: int = 512,
        temperature: float = 1.0,
    ) -> None:
        self.beta, self.loss_type = float(beta), loss_type
        self.low, self.high = float(epsilon), float(epsilon if epsilon_high is None else epsilon_high)
        self.max_completion_length, self.temperature = int(max_completion_length), float(temperature)
        self.metrics: dict[str, float] | None = None

    def count(self, target: Mapping[str, torch.Tensor]) -> int:
        """What the step's loss is a mean over, in this microbatch."""
        if self.loss_type == "dapo":
            return int((target["labels"][:, 1:] != IGNORE).sum())
        return int(target["labels"].shape[0])

    def reference(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The rows' per-token log-probs (the reference and old-policy passes' answer)."""
        return token_logps(output, target["labels"], self.temperature)[0].detach().cpu()

    def __call__(self, output: object, target: Mapping[str, torch.Tensor]) -> torch.Tensor:
        logps, mask, entropies = token_logps(output, target["labels"], self.temperature, entropy=True)
        old = target.get("old_logps")
        old = logps.detach() if old is None else old.to(logps.device, torch.float32)
        ratio = torch.exp(logps - old)
        advantages = target["advantages"].to(logps.device, torch.float32).unsqueeze(1)
        clipped = torch.clamp(ratio, 1 - self.low, 1 + self.high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        kl = None
        if self.beta:
            gap = target["ref_logps"].to(logps.device, torch.float32) - logps
            kl = (torch.exp(gap) - gap - 1) * ratio  # TRL's importance-sampling-corrected KL
            per_token = per_token + self.beta * kl
        mask_f = mask.float()
        summed = (per_token * mask_f).sum()
        if self.loss_type == "grpo":
            loss = ((per_token * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "dr_grpo":
            loss = summed / (per_token.shape[0] * self.max_completion_length)
        else:  # "dapo"
            loss = summed / mask_f.sum().clamp(min=1.0)
        self.metrics = self._sums(target, mask_f, ratio.detach(), advantages, entropies, kl)
        return loss

    def _sums(self, target, mask, ratio, advantages, entropies, kl) -> dict[str, float]:
        """The microbatch's metric sums: over rows, and over completion tokens."""
        rewards = target["rewards"].float()
        low = ((ratio < 1 - self.low) & (advantages < 0)).float()
        high = ((ratio > 1 + self.high) & (advantages > 0)).float()
        sums = {
            "rows": float(rewards.numel()),
            "tokens": float(mask.sum()),
            "reward": float(rewards.sum()),
            "reward_squares": float((rewards**2).sum()),
            "frac_reward_zero_std": float(target["zero_std"].float().sum()),
            "entropy": float((entropies * mask).sum()),
            "clip_ratio/low_mean": float((low * mask).sum()),
            "clip_ratio/high_mean": float((high * mask).sum()),
            "clip_ratio/region_mean": float((torch.maximum(low, high) * mask).sum()),
        }
        if kl is not None:
            sums["kl"] = float((kl.detach() * mask).sum())
        return sums

    def take_metrics(self) -> dict[str, float] | None:
        """The last microbatch's metric sums (then forgotten)."""
        metrics, self.metrics = self.metrics, None
        return metrics


def step_metrics(sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """TRL's metrics of a step, from every microbatch's sums: rewards over completions (their
    standard deviation unbiased, as TRL's `nanstd`), the rest over completion tokens."""
    sums = list(sums)
    rows, tokens = sum(s["rows"] for s in sums), sum(s["tokens"] for s in sums)
    if not rows:
        return {}
    total = sum(s["reward"] for s in sums)
    squares = sum(s["reward_squares"] for s in sums)
    variance = (squares - total * total / rows) / (rows - 1) if rows > 1 else 0.0
    metrics = {
        "reward": total / rows,
        "reward_std": max(variance, 0.0) ** 0.5,
        "frac_reward_zero_std": sum(s["frac_reward_zero_std"] for s in sums) / rows,
        "completions/mean_length": tokens / rows,
    }
    for name in TOKEN_MEANS:
        if all(name in s for s in sums):
            metrics[name] = sum(s[name] for s in sums) / max(tokens, 1.0)
    return metrics


@register
class GRPO(Objective):
    """Prompts whose G completions are generated from the policy and scored by reward functions
    before each generation batch (`driver.inference.rollout`), the rows then trained on against
    the group's rewards."""

    name = "grpo"
    defaults = {
        "name": "grpo",
        "beta": 0.0,
        "loss_type": "dapo",
        "num_generations": 8,
        "epsilon": 0.2,
        "epsilon_high": None,
        "scale_rewards": "group",
        "max_completion_length": 512,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "num_iterations": 1,
        "reward_funcs": [],
        "reward_weights": None,
        "tokenizer": None,
        "eos_token_id": None,
    }
    record = "prompt"
    data_source = "prompts"
    generates = True

    @classmethod
    def check(cls, settings: dict[str, Any], given: Any) -> None:
        from raypipe.objectives.rollouts import SCALINGS

        o = settings
        checks = [
            (_number(o["beta"]) and o["beta"] >= 0, "beta must be a number >= 0 (TRL's default is 0.0: no KL term)."),
            (o["loss_type"] in LOSS_TYPES, f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}."),
            (
                _int(o["num_generations"]) and o["num_generations"] >= 2,
                "num_generations must be an int >= 2 (a group).",
            ),
            (_number(o["epsilon"]) and o["epsilon"] > 0, "epsilon must be a number > 0 (TRL's default is 0.2)."),
            (
                o["epsilon_high"] is None or (_number(o["epsilon_high"]) and o["epsilon_high"] > 0),
                "epsilon_high: None or > 0.",
            ),
            (o["scale_rewards"] in SCALINGS, f"scale_rewards must be one of {', '.join(map(repr, SCALINGS))}."),
            (
                _int(o["max_completion_length"]) and o["max_completion_length"] >= 1,
                "max_completion_length: an int >= 1.",
            ),
            (_number(o["temperature"]) and o["temperature"] > 0, "temperature must be > 0 (GRPO samples)."),
            (_number(o["top_p"]) and 0 < o["top_p"] <= 1, "top_p must be in (0, 1]."),
            (o["top_k"] is None or (_int(o["top_k"]) and o["top_k"] >= 1), "top_k: None or an int >= 1."),
            (_int(o["num_iterations"]) and o["num_iterations"] >= 1, "num_iterations must be an int >= 1."),
            (
                isinstance(o["reward_funcs"], (list, tuple)),
                "reward_funcs: a list of callables or 'module:function' paths.",
            ),
            (
                o["tokenizer"] is None or isinstance(o["tokenizer"], str) or hasattr(o["tokenizer"], "batch_decode"),
                "tokenizer: None (completions as token ids), a model directory's path, or a tokenizer.",
            ),
            (o["eos_token_id"] is None or _int(o["eos_token_id"]), "eos_token_id: None or a token id."),
        ]
        for ok, fix in checks:
            if not ok:
                raise invalid_setting(given, fix)
        o["reward_funcs"] = list(o["reward_funcs"])
        for f in o["reward_funcs"]:
            if not callable(f) and not (isinstance(f, str) and ":" in f):
                raise invalid_setting(
                    given, f"reward function {f!r}: give a callable or an import path 'module:function'."
                )
        weights = o["reward_weights"]
        if weights is not None and (
            not isinstance(weights, (list, tuple))
            or len(weights) != len(o["reward_funcs"])
            or not all(map(_number, weights))
        ):
            raise invalid_setting(given, "reward_weights: None (all 1) or one number per reward function.")

    def loss(self) -> GRPOLoss:
        o = self.settings
        return GRPOLoss(
            o["beta"], o["loss_type"], o["epsilon"], o["epsilon_high"], o["max_completion_length"], o["temperature"]
        )

    def rows(self, rollout: Any) -> Rows:
        """The rows of a generation batch ({"prompt_ids", "completion_ids", "rewards"})."""
        from raypipe.objectives.rollouts import rollout_batch

        x, y = rollout_batch(rollout, self.settings["num_generations"], self.settings["scale_rewards"])
        return Rows(x=x, y=y, records=len(x["input_ids"]), extra={})

    def passes(self) -> list[LogProbPass]:
        return [LogProbPass("rows", "reference", "ref_logps")] if self.settings["beta"] > 0 else []

    def step_metrics(self, sums: Iterable[Mapping[str, float]]) -> dict[str, float]:
        return step_metrics(sums)

    def log_line(self, metrics: Mapping[str, object]) -> str:
        if "reward" not in metrics:
            return ""
        generated = f" | generated in {metrics['generation_s']:.2f} s" if "generation_s" in metrics else ""
        generated += " | tok/s counts generation" if "rows_s" in metrics else ""
        return (
            f" | reward {metrics['reward']:.3f} ± {metrics['reward_std']:.3f} | "
            f"length {metrics['completions/mean_length']:.1f}{generated}"
        )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
