"""Supervised fine-tuning data (`raypipe.data.sft`): the prompt's tokens are left out of the loss,
packed rows restart positions per example and transformers' masks keep examples apart (each
example's logits in a packed row equal its logits alone), chat records and JSONL files read,
the stdlib set is made from signatures and docstrings; the LoRA SFT example job runs."""

import json

import pytest
import torch

from raypipe import ConfigError, build_layers
from raypipe.data.hf_tokenizer import byte_tokenizer
from raypipe.data.sft import IGNORE, SFTDataset, read_jsonl, stdlib_docstrings

from hf_helpers import save_tiny

pytest.importorskip("transformers")

RECORDS = [
    {"prompt": "Q: hi\n", "response": "A: yo"},
    {"prompt": "Q: 2+2\n", "response": "A: 4"},
    {"messages": [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "raypipe"}]},
]


def test_prompt_tokens_are_left_out_of_the_loss_and_rows_are_padded():
    data = SFTDataset.from_records(RECORDS, byte_tokenizer(), block_size=16)
    x, labels = data.batch(0, 3)
    assert set(x) == {"input_ids", "attention_mask"} and x["input_ids"].shape == (3, 16)
    for row, lab, mask in zip(x["input_ids"], labels, x["attention_mask"]):
        text = bytes(row[mask.bool()].tolist()).decode()
        prompt = next(
            r.get("prompt", "user: name?\nassistant: ")
            for r in RECORDS
            if text.startswith(r.get("prompt", "user: name?"))
        )
        learned = lab[lab != IGNORE]
        assert (lab[: len(prompt)] == IGNORE).all() and bytes(learned.tolist()).decode() == text[len(prompt) :]
        assert (lab[~mask.bool()] == IGNORE).all()


def test_packed_examples_do_not_see_each_other(tmp_path):
    from raypipe.models import hf

    model = hf.from_pretrained(save_tiny("llama", str(tmp_path), vocab_size=256))
    layers = torch.nn.Sequential(*build_layers(model.layers))
    data = SFTDataset.from_records(RECORDS, byte_tokenizer(), block_size=48, pack=True)
    x, labels = data.batch(0, 1)
    positions = x["position_ids"][0]
    starts = [i for i in range(len(positions)) if positions[i] == 0]
    assert len(starts) >= 3  # several examples (and the padding) share the row
    with torch.no_grad():
        packed = layers(x)[0]
        for a, b in zip(starts, starts[1:] + [len(positions)]):
            alone = layers(x["input_ids"][:, a:b])[0]
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-5)


def test_records_are_read_from_jsonl_and_the_stdlib(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    assert read_jsonl(path) == RECORDS
    path.write_text('{"question": "?"}\n')
    with pytest.raises(ConfigError, match=r"sft.jsonl:1: give 'prompt' and 'response', or 'messages'"):
        read_jsonl(path)
    made = stdlib_docstrings(limit=20)
    assert len(made) == 20 and all(r["prompt"].startswith("def ") and r["response"].endswith('"""\n') for r in made)


@pytest.mark.slow
def test_the_lora_sft_job_fine_tunes_an_export_and_saves_adapters_peft_loads(ray_session, tmp_path):
    from peft import PeftModel

    from raypipe.job import JobConfig, run

    from hf_helpers import load, small_job

    base = save_tiny("llama", str(tmp_path / "base"), vocab_size=256)
    small = small_job(
        base,
        "job.eval_every=0",
        "job.eval_batches=1",
        "job.sample_tokens=4",
        f"job.save_adapter={tmp_path / 'adapter'}",
        f"job.save_pretrained={tmp_path / 'merged'}",
    )
    lines = []
    summary = run(JobConfig.from_yaml("examples/configs/lora_sft.yaml", small), log=lines.append)
    assert len(summary["losses"]) == 4 and any(line.startswith("sample before training") for line in lines)
    merged = load(str(tmp_path / "merged"))
    adapted = PeftModel.from_pretrained(load(base), str(tmp_path / "adapter"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
