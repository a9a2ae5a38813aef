"""The state of one microbatch of rows being generated, kept on the actors that use it: the stage
that starts the model turns each picked token into the next forward's input (`Feed`), the stage
that ends it picks each row's next token (`Picker`). With both on the actors, a token never goes
through the driver between two forwards, so calls are queued ahead and a pipeline decodes several
microbatches in flight (`raypipe.driver.inference.generation`).
"""

from __future__ import annotations

import torch

from raypipe.nn.sampling import pick


class Feed:
    """The first stage's inputs for one microbatch: the prompt, then each new token.

    With a KV cache (`cached`) a forward after the prompt takes only the new token with its
    position; without one, the whole sequence so far. Positions count a row's real tokens from its
    mask (left padding), as transformers' `generate` numbers them.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cached: bool) -> None:
        self.sequence, self.mask, self.cached = input_ids, attention_mask, cached

    def prompt(self) -> object:
        """The first forward's input: the whole prompt."""
        return self._input(first=True)

    def next(self, token: torch.Tensor) -> object:
        """The input after `token` (one per row) was picked."""
        self.sequence = torch.cat([self.sequence, token.reshape(-1, 1).to(self.sequence.dtype)], dim=1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        return self._input(first=False)

    def _input(self, first: bool) -> object:
        sequence, mask = self.sequence, self.mask
        if not self.cached:
            return sequence if mask is None else {"input_ids": sequence, "attention_mask": mask}
        if mask is None:
            positions = torch.arange(sequence.shape[1]).unsqueeze(0)
        else:
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        x = {
            "input_ids": sequence if first else sequence[:, -1:],
            "position_ids": positions if first else positions[:, -1:],
        }
        if mask is not None:
            x["attention_mask"] = mask
        return x


class Picker:
    """The last stage's choice of each row's next token for one microbatch: greedy or sampled
    (`pick`) from a generator seeded when the microbatch starts; once a row has produced
    `eos_token_id` it goes on with it, as transformers pads finished rows."""

    def __init__(
        self,
        rows: int,
        temperature: float,
        top_k: int | None,
        top_p: float,
        seed: int | None,
        eos_token_id: int | None,
    ) -> None:
        self.temperature, self.top_k, self.top_p, self.eos_token_id = temperature, top_k, top_p, eos_token_id
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.done = torch.zeros(rows, dtype=torch.bool)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from its last position's `logits` (rows, vocab)."""
        token = pick(logits, self.temperature, self.top_k, self.generator, self.top_p)
        if self.eos_token_id is not None:
            token = token.masked_fill(self.done, self.eos_token_id)
            self.done |= token == self.eos_token_id
        return token

    @property
    def finished(self) -> bool:
        """Every row has produced the end-of-text token."""
        return self.eos_token_id is not None and bool(self.done.all())
