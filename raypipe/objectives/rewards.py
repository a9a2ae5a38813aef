"""A GRPO run's reward functions: Python callables, or import paths "module:function" (what a YAML
job names), each called as TRL calls them and summed with their weights."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raypipe.core.errors import BatchError, ConfigError


def resolve(function: Callable | str) -> Callable:
    """The callable `function` names ("package.module:function"), or `function` itself.

    Raises:
        ConfigError: the module or the function cannot be found.
    """
    if callable(function):
        return function
    module, _, name = function.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(
            f"TrainConfig.objective reward function {function!r} cannot be imported ({type(error).__name__}: {error}); "
            "give 'package.module:function' on the driver's Python path"
        ) from error
    if not callable(found):
        raise ConfigError(
            f"TrainConfig.objective reward function {function!r} is a {type(found).__name__}, not callable"
        )
    return found


class RewardFunctions:
    """The objective's `reward_funcs` with their `reward_weights` (all 1 when None), the tokenizer
    that decodes completions for them (`tokenizer`: one, a model directory, or None for token ids) and
    the end-of-text token that ends a completion (`eos_token_id`, else the tokenizer's)."""

    def __init__(self, objective: Mapping[str, Any]) -> None:
        self.functions = [resolve(f) for f in objective["reward_funcs"]]
        if not self.functions:
            raise ConfigError(
                "TrainConfig.objective has no reward_funcs: GRPO's fit scores each completion with them; give "
                "[callable or 'module:function', ...] (Trainer.step takes rewards you computed yourself)"
            )
        self.names = [getattr(f, "__name__", type(f).__name__) for f in self.functions]
        weights = objective["reward_weights"]
        self.weights = [1.0] * len(self.functions) if weights is None else [float(w) for w in weights]
        self.tokenizer = objective.get("tokenizer")
        if isinstance(self.tokenizer, str):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        eos = objective.get("eos_token_id")
        self.eos_token_id = eos if eos is not None else getattr(self.tokenizer, "eos_token_id", None)

    def score(
        self, records: Sequence[Mapping[str, object]], completions: Sequence[Sequence[int]]
    ) -> tuple[list[float], dict[str, float]]:
        """Each completion's reward, the weighted sum of every function's answer for it, and each
        function's mean answer (TRL's `rewards/<name>/mean`). A function is
        called as TRL calls it, `f(prompts=..., completions=..., completion_ids=..., **columns)`, with
        one entry per completion (`records` holds its prompt's record): `prompts` the records' "prompt"
        (else their token ids), `completions` the decoded texts (token ids without a tokenizer), and
        every other column of the records, such as the expected answer.

        A function may abstain for a completion with None (TRL's convention: its NaN-aware sum leaves
        it out), and may answer with a numpy array.

        Raises:
            BatchError: a function did not return one number (or None) per completion, every
                function abstained for one, or a record's column takes a name the call gives itself.
        """
        clash = sorted({"prompts", "completions", "completion_ids"} & set(records[0]))
        if clash:
            raise BatchError(
                f"prompt records hold the column {clash[0]!r}, a name the reward functions are called with already "
                f"(prompts, completions, completion_ids): rename that column"
            )
        columns = {k: [r.get(k) for r in records] for k in records[0] if k != "prompt"}
        texts = (
            self.tokenizer.batch_decode(completions, skip_special_tokens=True) if self.tokenizer else list(completions)
        )
        prompts = [r.get("prompt", r["prompt_ids"]) for r in records]
        total, answered, means = [0.0] * len(completions), [False] * len(completions), {}
        for name, f, w in zip(self.names, self.functions, self.weights):
            got = f(prompts=prompts, completions=texts, completion_ids=[list(c) for c in completions], **columns)
            got = got.tolist() if hasattr(got, "tolist") else got  # a numpy array, a tensor
            values = list(got) if isinstance(got, Sequence) else None
            if values is None or len(values) != len(completions):
                raise BatchError(
                    f"reward function {name} returned {type(got).__name__}"
                    f"{'' if values is None else f' of {len(values)}'}: give one float per completion "
                    f"({len(completions)})"
                )
            given = []
            for r, v in enumerate(values):
                if v is None:  # this function abstains for this completion
                    continue
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                    raise BatchError(f"reward function {name} gave completion {r} {v!r}: give a finite number or None")
                total[r] += w * float(v)
                answered[r] = True
                given.append(float(v))
            if given:
                means[f"rewards/{name}/mean"] = sum(given) / len(given)
        if not all(answered):
            raise BatchError(
                f"every reward function gave None for completion {answered.index(False)}: at least one must score it"
            )
        return total, means
