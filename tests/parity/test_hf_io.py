"""HuggingFace models in and out: each stage actor reads only its own layers' tensors from the
safetensors files (the driver none), a trained model saved with `save_pretrained` loads in
transformers with the same logits, greedy generation through the pipeline (with per-stage KV
caches) equals transformers' token for token, models from a config start with their tied
copies equal, and unsupported models get an error naming them."""

import json
import os

import pytest
import torch

from raypipe import ConfigError, StageError, TrainConfig, Trainer
from raypipe.models import hf
from raypipe.models.hf import tensor_files

from hf_helpers import FAMILY_SHAPE, VOCAB, lm_batch, load, save_tiny, tiny_config

pytest.importorskip("transformers")

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
CONFIG = dict(microbatches=2, optimizer=SGD, cpus_per_actor=0.25, threads_per_actor=1)


def file_tensors(directory):
    """Every tensor's key and size in a model directory's safetensors files."""
    from safetensors import safe_open

    sizes = {}
    for key, path in tensor_files.files_by_key(directory).items():
        with safe_open(path, framework="pt") as f:
            t = f.get_slice(key)
            sizes[key] = int(torch.Size(t.get_shape()).numel()) * {"F32": 4, "BF16": 2}[t.get_dtype()]
    return sizes


@pytest.fixture(scope="module")
def llama(ray_session, tmp_path_factory):
    """A tiny Llama in three stages, from a directory of two safetensors shards."""
    directory = str(tmp_path_factory.mktemp("llama"))
    from transformers import AutoModelForCausalLM

    save_tiny("llama", directory)
    AutoModelForCausalLM.from_pretrained(directory).save_pretrained(directory, max_shard_size="20KB")
    tensor_files.last_read.clear()  # what earlier tests' one-process references read in this process
    with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=3, **CONFIG)) as t:
        yield t, directory


@pytest.fixture(scope="module")
def gpt2(ray_session, tmp_path_factory):
    directory = save_tiny("gpt2", str(tmp_path_factory.mktemp("gpt2")))
    with Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=2, **CONFIG)) as t:
        yield t, directory


def test_each_actor_reads_only_its_own_tensors_and_the_driver_none(llama):
    trainer, directory = llama
    assert os.path.exists(os.path.join(directory, tensor_files.INDEX))  # sharded: the index is honoured
    on_disk = file_tensors(directory)
    read = [info["weights_read"] for info in trainer.stage_info()]
    keys = [set(r) for r in read]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1 :])  # no tensor read twice
    assert set().union(*keys) == set(on_disk)
    assert sum(sum(r.values()) for r in read) == sum(on_disk.values())
    names = hf.from_pretrained(directory).exporter.names(trainer.specs)
    for (start, end), mine in zip(trainer.plan, keys):  # exactly the tensors of its own layers
        assert mine == {names[k] for k in names if start <= int(k.split(".")[0]) < end}
    assert tensor_files.last_read == {}  # this process (the driver) read no tensor


def test_a_tied_head_reads_the_embedding_on_its_own_stage(gpt2):
    trainer, directory = gpt2
    read = [info["weights_read"] for info in trainer.stage_info()]
    assert "lm_head.weight" not in file_tensors(directory)  # transformers saves a tied head once
    assert "transformer.wte.weight" in read[0] and "transformer.wte.weight" in read[1]
    assert set(read[0]) & set(read[1]) == {"transformer.wte.weight"}


@pytest.mark.slow
def test_a_trained_model_saved_in_hf_format_loads_in_transformers_with_the_same_logits(gpt2, tmp_path):
    trainer, _ = gpt2
    for k in range(2):
        trainer.step(*lm_batch(k))
    out = trainer.save_pretrained(str(tmp_path / "out"))
    index = json.loads((out / tensor_files.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    # one file per layer, each written by its stage's actor: a stage's memory grows by a layer at most
    assert files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert all(index["weight_map"][k] == files[2] for k in index["weight_map"] if ".h.1." in k)
    model = load(str(out))
    x, _ = lm_batch(5)
    with torch.no_grad():
        expected = model(**x).logits
    torch.testing.assert_close(trainer.predict(x), expected, rtol=1e-5, atol=1e-5)
    # the weights are those trained, not the ones loaded
    assert not torch.equal(model.transformer.wte.weight, load_original(trainer).transformer.wte.weight)


def load_original(trainer):
    return load(trainer.model.source)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_greedy_generation_equals_transformers_token_for_token(request, which):
    trainer, _ = request.getfixturevalue(which)
    directory = str(request.getfixturevalue("tmp_path") / "now")
    trainer.save_pretrained(directory)  # whatever the trainer holds now
    model = load(directory)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(trainer.generate(prompt, max_new_tokens=8), expected)
    # top_k=1 samples the most likely token whatever the temperature
    assert torch.equal(trainer.generate(prompt, max_new_tokens=4, temperature=0.7, top_k=1, seed=1), expected[:, :9])


@pytest.mark.slow
def test_a_model_from_config_trains_with_its_tied_copies_equal(ray_session):
    model = hf.from_config(tiny_config("gpt2"))
    with Trainer(model, config=TrainConfig(pp=2, seed=3, **CONFIG)) as t:
        last = len(t.specs) - 1
        state = t.state_dict()
        assert torch.equal(state["0.wte.weight"], state[f"{last}.lm_head.weight"])  # the head started as the embedding
        assert 0.015 < float(state["1.block.attn.c_attn.weight"].std()) < 0.025  # transformers' N(0, 0.02)
        losses = [t.step(*lm_batch(0))["loss"] for _ in range(5)]
        assert losses[-1] < losses[0]
        state = t.state_dict()
        assert torch.equal(state["0.wte.weight"], state[f"{last}.lm_head.weight"])


def test_a_model_type_without_a_pipeline_plan_is_named_with_the_layerspec_way_out():
    from transformers import BertConfig

    with pytest.raises(ConfigError, match=r"(?s)'bert'.*declares no base_model_pp_plan.*LayerSpec\(MyBlock, cfg, i\)"):
        hf.from_config(BertConfig())
    with pytest.raises(ConfigError, match="no such directory"):
        hf.from_pretrained("/nonexistent/model")
    with pytest.raises(ConfigError, match="dtype='fp8'"):
        hf.from_config(tiny_config("llama"), dtype="fp8")


@pytest.mark.slow
def test_generation_from_left_padded_prompts_equals_transformers(llama, tmp_path):
    trainer, _ = llama
    trainer.save_pretrained(str(tmp_path / "now"))
    model = load(str(tmp_path / "now"))
    prompt = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    mask[2, :4] = 0
    expected = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(trainer.generate(prompt, max_new_tokens=6, attention_mask=mask), expected)
    # the rows split into one microbatch per stage, decoding in flight; a row that produced the
    # end-of-text token goes on with it, and generation ends once every row has
    eos = int(expected[0, 7])
    stops = model.generate(
        prompt, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    assert torch.equal(trainer.generate(prompt, max_new_tokens=6, attention_mask=mask, eos_token_id=eos), stops)


@pytest.mark.slow
def test_the_example_jobs_train_a_llama_from_config_then_fine_tune_its_export(ray_session, tmp_path):
    from raypipe.job import JobConfig, run

    small = [
        "job.steps=4",
        "job.eval_every=0",
        "job.eval_batches=1",
        "job.batch_size=8",
        "job.sample_tokens=8",
        "data.max_bytes=200000",
        "log_dir=null",
        "job.progress=false",
        "cpus_per_actor=0.25",
        "threads_per_actor=1",
    ]
    first = JobConfig.from_yaml(
        "examples/configs/llama_pp2.yaml",
        small + [f"job.save_pretrained={tmp_path / 'hf'}", "model.hf.num_hidden_layers=2"],
    )
    lines = []
    trained = summary = run(first, log=lines.append)
    assert len(summary["losses"]) == 4 and summary["losses"][-1] < summary["losses"][0]
    assert any("transformers model (llama from config fields" in line for line in lines)
    assert load(str(tmp_path / "hf")).config.num_hidden_layers == 2  # transformers reads the export
    second = JobConfig.from_yaml(
        "examples/configs/llama_finetune.yaml",
        small + [f"model.hf={tmp_path / 'hf'}", f"job.save_pretrained={tmp_path / 'tuned'}"],
    )
    summary = run(second, log=lines.append)
    # it starts from the exported weights: the same validation loss, now in three stages
    assert summary["val_first"] == pytest.approx(trained["val_last"], rel=1e-5)
    assert (tmp_path / "tuned" / tensor_files.INDEX).exists()


@pytest.mark.slow
def test_the_reference_gpt_exports_as_a_gpt2_transformers_loads(ray_session, tmp_path):
    from raypipe.models import gpt, gpt_export

    cfg = gpt.GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    with Trainer(gpt_export.model(cfg), config=TrainConfig(pp=2, **CONFIG)) as t:
        x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
        t.step(x, x.roll(-1, dims=1))
        model = load(str(t.save_pretrained(str(tmp_path / "gpt"))))
        assert type(model).__name__ == "GPT2LMHeadModel"
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, t.predict(x), rtol=1e-5, atol=1e-5)


def test_importing_raypipe_imports_nothing_of_transformers():
    import subprocess
    import sys

    code = (
        "import sys, raypipe, raypipe.models, raypipe.models.hf, raypipe.job; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'safetensors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_mistral_and_qwen2_layers_give_transformers_logits(tmp_path, kind):
    """The Llama-shaped families beside Llama, in one process: Mistral with a sliding window shorter
    than the sequence, Qwen2 with its head tied; with and without a padding mask."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    from raypipe import build_layers

    common = {**FAMILY_SHAPE, "num_hidden_layers": 2}
    config = (
        MistralConfig(sliding_window=4, **common)
        if kind == "mistral"
        else Qwen2Config(tie_word_embeddings=True, **common)
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    model = hf.from_pretrained(str(tmp_path))
    assert bool(model.tied) == (kind == "qwen2")
    layers = torch.nn.Sequential(*build_layers(model.layers))
    reference = load(str(tmp_path))
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        assert torch.equal(layers(ids), reference(ids).logits)
        assert torch.equal(
            layers({"input_ids": ids, "attention_mask": mask}), reference(ids, attention_mask=mask).logits
        )


def test_tensor_parallelism_without_a_plan_is_refused_naming_the_layer(ray_session, tmp_path):
    directory = save_tiny("gpt2", str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=r"layer 1 \(LayerSpec\(build, 'decoder', gpt2\(hidden_size=16.*no "
        r"base_model_tp_plan .* use tp=1",
    ):
        Trainer(hf.from_pretrained(directory), config=TrainConfig(pp=1, tp=2, **CONFIG))


def test_a_malformed_or_truncated_model_directory_is_named_before_any_actor_starts(tmp_path):
    """Bad model files are a ConfigError naming the file, from the driver: not a traceback in an actor."""
    import shutil

    good = save_tiny("llama", str(tmp_path / "good"))
    assert hf.from_pretrained(good).vocab_size == VOCAB  # the driver checks token ids against it
    broken = tmp_path / "config"
    shutil.copytree(good, broken)
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ConfigError, match=r"config.json cannot be read as a transformers config"):
        hf.from_pretrained(str(broken))
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights_file = truncated / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-100])
    with pytest.raises(ConfigError, match=r"model.safetensors is truncated: its header promises \d+ bytes"):
        hf.from_pretrained(str(truncated))
    garbage = tmp_path / "garbage"
    shutil.copytree(good, garbage)
    (garbage / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"model.safetensors is not a readable safetensors file"):
        hf.from_pretrained(str(garbage))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_stage_reads_each_tensor_once_straight_into_its_parameters(tmp_path, dtype):
    """A stage holding a tied head and its embedding: the head takes the embedding's tensor instead
    of reading a copy; every weight equals transformers' own load, in the asked dtype."""
    from raypipe.actors.stage_model import StageModel
    from raypipe.nn import TensorParallelGroup

    directory = save_tiny("gpt2", str(tmp_path / "gpt2"))
    model = hf.from_pretrained(directory, dtype=dtype)
    stage = StageModel(model.layers, 0, 0, torch.device("cpu"), TensorParallelGroup(0, 1), model.tied)
    embedding, head = stage.module[0], stage.module[-1]
    assert "transformer.wte.weight" in embedding.read_keys and "transformer.wte.weight" not in head.read_keys
    assert head.lm_head.weight.untyped_storage().data_ptr() == embedding.wte.weight.untyped_storage().data_ptr()
    expected = load(directory).to(tensor_files.DTYPES[dtype]).state_dict()
    names = model.exporter.names(model.layers)
    state = stage.state_dict()
    assert {names[k] for k in state if names[k]} == set(expected) - {"lm_head.weight"}
    for key, value in state.items():
        if names[key]:
            assert value.dtype == tensor_files.DTYPES[dtype] and torch.equal(value, expected[names[key]]), key


def test_a_cpu_stages_frozen_lora_base_is_a_view_of_its_file_and_its_embedding_reads_rows(tmp_path, monkeypatch):
    """Under LoRA a CPU stage's frozen weights are views of the model's file, not copies: building
    the stages touches none of their pages; an embedding reads the rows it looks up (the same rows,
    its table never resident), a tied head on another stage maps the pages its logits read; the
    adapters are the process's own; writes never reach the file (a trained bias copies its page);
    raypipe writing over the file leaves the stages' weights as they were. Without LoRA, or in
    another dtype than the file's, or from a file system that will not map it, every weight is read
    as before; a stage holding a tied head beside its embedding indexes the table it reads whole
    anyway."""
    from safetensors import safe_open

    from raypipe.actors.io.checkpoint_io import save_tensors
    from raypipe.actors.optim.zero3 import ShardedStage
    from raypipe.actors.stage_model import StageModel
    from raypipe.actors.step.memory import resident_bytes_of
    from raypipe.nn import TensorParallelGroup

    directory = save_tiny("gpt2", str(tmp_path / "gpt2"), vocab_size=32768)  # a 2 MB embedding
    path = os.path.join(directory, tensor_files.SINGLE)
    model, tp, lora = hf.from_pretrained(directory), TensorParallelGroup(0, 1), {"r": 2, "target_modules": ["c_attn"]}
    cpu = torch.device("cpu")
    first = StageModel(model.layers[:3], 0, 0, cpu, tp, model.tied, lora)
    embedding = first.module[0].wte.weight
    assert first.mapped_files() == {path} and not embedding.requires_grad
    assert first.trainable() and not any(id(p) in first.mapped for p in first.trainable())
    assert all(first.mapped[id(p)] == path for p in first.params if not p.requires_grad)
    assert first.mapped_bytes() == sum(p.numel() * p.element_size() for p in first.params if not p.requires_grad)
    assert first.tables_read_from_files == ["0.wte", "0.wpe"]
    last = StageModel(model.layers[3:], 3, 0, cpu, tp, model.tied, lora)
    head = last.module[-1].lm_head.weight
    assert last.mapped[id(head)] == path and head.data_ptr() != embedding.data_ptr()  # two mappings
    ids = torch.tensor([[1, 7, 30000, 7], [32767, 0, 5, 1]])
    looked_up = first.module[0](ids)["hidden_states"]
    assert resident_bytes_of({path}) == 0  # built and looked up: no page of the file mapped in
    with pytest.raises(IndexError, match="index out of range"):
        first.module[0](torch.tensor([[32768]]))
    assert last.tables_read_from_files == ["2.lm_head"]  # the head of the tie, on another stage
    hidden = torch.randn(1, 2, 16, requires_grad=True)
    logits = last.module[-1]({"hidden_states": hidden, "attention_mask": None, "position_ids": None})
    logits.square().sum().backward()
    whole = embedding.numel() * embedding.element_size()
    assert resident_bytes_of({path}) < whole / 8  # the head's pages handed back once used (the norm's stay)
    expected = load(directory).state_dict()  # transformers' own load, after the counting
    reference = hidden.detach().requires_grad_()
    normed = torch.nn.functional.layer_norm(
        reference, (16,), expected["transformer.ln_f.weight"], expected["transformer.ln_f.bias"]
    )
    want = normed @ expected["transformer.wte.weight"].t()
    want.square().sum().backward()
    assert torch.equal(logits, want) and torch.equal(hidden.grad, reference.grad)  # one block: F.linear itself
    assert torch.equal(embedding, expected["transformer.wte.weight"])
    wte, wpe = expected["transformer.wte.weight"], expected["transformer.wpe.weight"]
    assert torch.equal(looked_up, wte[ids] + wpe[torch.arange(4)])  # GPT-2 adds the positions' rows

    bias = first.module[1].block.ln_1.bias  # as `bias="all"` trains it: copy-on-write, the file untouched
    bias.data.add_(1.0)
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_tensor("transformer.h.0.ln_1.bias"), expected["transformer.h.0.ln_1.bias"])
    save_tensors({"w": torch.zeros(3)}, {"w": "w"}, path)  # raypipe writing over the directory's file
    assert torch.equal(head, wte)  # the stages keep the weights they had, and look them up
    assert torch.equal(first.module[0](ids)["hidden_states"], looked_up)
    with safe_open(path, framework="pt") as f:
        assert list(f.keys()) == ["w"]
    with torch.no_grad():
        first.module[0].wte.weight[7] = 0.0  # a written table is indexed, not read from the file
    assert torch.equal(first.module[0](torch.tensor([[7]]))["hidden_states"], wpe[:1].unsqueeze(0))

    model = hf.from_pretrained(save_tiny("gpt2", str(tmp_path / "again")))
    for read in (
        StageModel(model.layers[:2], 0, 0, cpu, tp, model.tied),  # trained whole: read
        StageModel(hf.from_pretrained(model.source, dtype="bf16").layers[:2], 0, 0, cpu, tp, (), lora),
    ):
        assert read.mapped_files() == set() and read.mapped_bytes() == 0
    real = torch.UntypedStorage.from_file

    def unmappable(path, *args, **kwargs):  # raypipe's mapping fails (safetensors' own, by keywords, goes on)
        if args:
            raise RuntimeError("this file system does not map files")
        return real(path, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(torch.UntypedStorage, "from_file", unmappable)
        assert StageModel(model.layers[:2], 0, 0, cpu, tp, model.tied, lora).mapped_bytes() == 0
    whole_model = StageModel(model.layers, 0, 0, cpu, tp, model.tied, lora)  # the tie on one stage
    assert whole_model.mapped_bytes() > 0 and whole_model.tables_read_from_files == ["0.wpe"]
    with pytest.raises(StageError, match="shares one"):  # ZeRO-3 frees each weight's own storage
        ShardedStage(whole_model.module, 0, 1, None)
    ids = torch.tensor([[3, 1, 4, 1]])
    before = whole_model.module[0](ids)["hidden_states"]
    whole_model.own_mapped()  # as `zero=3` does first
    assert whole_model.mapped_bytes() == 0
    assert torch.equal(whole_model.module[0](ids)["hidden_states"], before)  # indexed now, the same rows
    ShardedStage(whole_model.module, 0, 1, None)
