"""docs/models.md's first two blocks run as a reader would run them, one after the other: a
transformers Llama trained, saved and sampled; then fine-tuned with LoRA, its adapters read back
by peft and its merged export by transformers, giving the same logits."""

import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_the_transformers_and_lora_blocks_of_models_md_run_and_their_exports_load(ray_session, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    first, lora = blocks[0], next(b for b in blocks if "save_adapter" in b)
    monkeypatch.chdir(tmp_path)  # where the blocks write out/, adapter/ and merged/
    scope: dict = {}
    exec(compile(first, "models.md:first block", "exec"), scope)
    exec(compile(lora, "models.md:LoRA block", "exec"), scope)
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    with torch.no_grad():
        ids = scope["input_ids"][:2]
        tuned, merged = scope["tuned"](ids).logits, scope["merged"](ids).logits
        base = scope["AutoModelForCausalLM"].from_pretrained("out/")(ids).logits
    torch.testing.assert_close(merged, tuned, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(tuned, base, atol=1e-4)  # the adapters trained: not the base's logits
