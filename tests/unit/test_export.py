"""What `Trainer.save_pretrained` refuses before any actor writes: a model with no pretrained
format, and a reference GPT that GPT-2's format cannot hold (no biases, or experts)."""

import pytest
from torch import nn

from raypipe import ConfigError, LayerSpec, RaypipeError
from raypipe.driver import export
from raypipe.models import gpt, gpt_export
from raypipe.models.model import Model


@pytest.mark.parametrize(
    "model, error, words",
    [
        (Model([LayerSpec(nn.Linear, 2, 2)], nn.functional.mse_loss), RaypipeError, "no pretrained format"),
        (gpt_export.model(gpt.GPTConfig(n_layer=1, n_embd=8, n_head=2, bias=False)), ConfigError, "model.bias=False"),
        (gpt_export.model(gpt.GPTConfig(n_layer=1, n_embd=8, n_head=2, num_experts=4)), ConfigError, "num_experts=4"),
    ],
)
def test_a_model_its_format_cannot_hold_is_refused_before_anything_is_written(model, error, words, tmp_path):
    with pytest.raises(error, match=words):
        export.save_pretrained(model, [], model.layers, str(tmp_path / "out"), 1, False)
    assert not (tmp_path / "out").exists()
