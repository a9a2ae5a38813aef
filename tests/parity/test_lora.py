"""LoRA fine-tuning of a split transformers model through peft: exact parity with peft on the
one-process transformers model (losses, adapter gradients, adapter weights after 3 SGD-momentum
steps; base weights untouched bit for bit) for pp 1, 2, 3, both schedules, dp 2; adapters saved
in peft's format load in `PeftModel.from_pretrained` with the same logits, load back into a
trainer, and merge into a transformers directory."""

import pytest
import torch

from raypipe import ConfigError, TrainConfig, Trainer
from raypipe.models import hf
from raypipe.models.hf import adapters

from helpers import assert_close_dicts
from hf_helpers import hf_reference, lm_batch, load, run_schedules, save_tiny

pytest.importorskip("peft")

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def lora(kind):
    return {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": TARGETS[kind]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return {kind: save_tiny(kind, str(tmp_path_factory.mktemp(kind))) for kind in ("llama", "gpt2")}


def peft_reference(directory, kind, initial):
    """peft's LoRA on the one-process transformers model, from raypipe's initial adapters: losses,
    the adapters' first gradients and final weights under peft's saved names."""
    import warnings

    from peft import get_peft_model, set_peft_model_state_dict

    from raypipe.nn.lora import peft_config

    def prepare(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's Conv1D: peft notes fan_in_fan_out
            model = get_peft_model(model, peft_config(lora(kind)))
        set_peft_model_state_dict(model, initial)
        return model

    losses, grads, final = hf_reference(directory, prepare=prepare)
    return losses, grads, {k: v for k, v in final.items() if ".lora_" in k}


CASES = [("llama", 1, 1), ("llama", 2, 1), ("llama", 3, 1), ("gpt2", 2, 2)]


def check_against_peft(trainer, model, kind, directory, schedules=None):
    """Under each schedule (`run_schedules`' three unless given), from the trainer's first weights:
    the losses, the adapters' first gradients and final weights are peft's in one process, and
    the base weights are untouched bit for bit."""
    start = trainer.state_dict()
    prefixes = model.exporter.prefixes(trainer.specs)
    initial = {k: v for k, v in start.items() if ".lora_" in k}
    names = adapters.peft_names(list(initial), prefixes)
    reference = peft_reference(directory, kind, {names[k]: v for k, v in initial.items()})
    for losses, grads, final in run_schedules(trainer, start, schedules=schedules).values():
        assert set(grads) == set(initial)  # only adapters have gradients
        assert_close_dicts({names[k]: v for k, v in grads.items()}, reference[1])
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=4e-5)
        assert_close_dicts({names[k]: final[k] for k in initial}, reference[2])
        assert all(torch.equal(final[k], v) for k, v in start.items() if k not in initial)  # base bit-identical


@pytest.mark.slow
@pytest.mark.parametrize("kind, pp, dp", CASES, ids=[f"{k}-pp{p}-dp{d}" for k, p, d in CASES])
def test_lora_matches_peft_in_one_process_and_leaves_the_base_untouched(ray_session, saved, kind, pp, dp):
    model = hf.from_pretrained(saved[kind])
    config = TrainConfig(
        pp=pp, dp=dp, microbatches=4 // dp, optimizer=SGD, lora=lora(kind), cpus_per_actor=0.25, threads_per_actor=1
    )
    with Trainer(model, config=config) as t:
        assert all(i["optimizer_state_bytes"] == 0 for i in t.stage_info())  # nothing stepped yet
        check_against_peft(t, model, kind, saved[kind])


@pytest.mark.slow
def test_lora_under_the_v_schedules_matches_peft(ray_session, saved):
    """A transformers Llama's LoRA adapters in a V of chunks (pp 2, 4 virtual stages of its 6
    layers): DualPipeV, its forwards paired with the other chunk's whole backwards, and ZB-V,
    every backward split, where the frozen base leaves W the adapters alone; then DualPipeV with
    the layers compiled."""
    model = hf.from_pretrained(saved["llama"])
    config = TrainConfig(
        pp=2,
        schedule="dualpipe-v",
        microbatches=4,
        optimizer=SGD,
        lora=lora("llama"),
        cpus_per_actor=0.25,
        threads_per_actor=1,
    )
    with Trainer(model, config=config) as t:
        assert [i["virtual_stages"] for i in t.stage_info()] == [[0, 3], [1, 2]]
        check_against_peft(t, model, "llama", saved["llama"], schedules=("dualpipe-v", "zb-v"))
        t.reconfigure(compile=True)  # the decoder layers compiled with their adapters
        check_against_peft(t, model, "llama", saved["llama"], schedules=("dualpipe-v",))
        assert t.step(*lm_batch(0))["stages"][0]["compiled"]["graph_breaks"] == 0


def test_adapters_round_trip_through_peft_and_merge_into_transformers(ray_session, saved, tmp_path):
    from peft import PeftModel

    directory = saved["llama"]
    config = TrainConfig(
        pp=2, microbatches=2, optimizer=SGD, lora=lora("llama"), cpus_per_actor=0.25, threads_per_actor=1
    )
    x, _ = lm_batch(9)
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        for k in range(3):
            t.step(*lm_batch(k))
        trained = t.predict(x)
        t.save_adapter(str(tmp_path / "adapter"))
        assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        peft_model = PeftModel.from_pretrained(load(directory), str(tmp_path / "adapter"))
        with torch.no_grad():
            torch.testing.assert_close(peft_model(**x).logits, trained, rtol=1e-5, atol=1e-5)
        merged = load(str(t.save_pretrained(str(tmp_path / "merged"), merge_adapters=True)))
        with torch.no_grad():
            torch.testing.assert_close(merged(**x).logits, trained, rtol=1e-5, atol=1e-5)
        base = load(str(t.save_pretrained(str(tmp_path / "base"))))  # without merging: the untouched base
        assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), load(directory).state_dict().values()))
    with Trainer(hf.from_pretrained(directory), config=config.replace(pp=1)) as fresh:
        assert not torch.allclose(fresh.predict(x), trained)
        fresh.load_adapter(str(tmp_path / "adapter"))
        torch.testing.assert_close(fresh.predict(x), trained, rtol=1e-5, atol=1e-5)


def test_lora_settings_are_checked_with_what_to_give():
    with pytest.raises(ConfigError, match=r"lora.r=0 is invalid"):
        TrainConfig(lora={"r": 0, "target_modules": ["q_proj"]})
    with pytest.raises(ConfigError, match=r"lora.target_modules=None is invalid.*q_proj"):
        TrainConfig(lora={"r": 4})
    with pytest.raises(ConfigError, match=r"lora with tp=2 is not supported"):
        TrainConfig(tp=2, lora={"target_modules": ["q_proj"]})
    from peft import LoraConfig

    given = TrainConfig(lora=LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], use_rslora=True)).lora
    assert {k: given[k] for k in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")} == {
        "r": 2,
        "lora_alpha": 4,
        "lora_dropout": 0.0,
        "target_modules": ["v_proj"],
        "use_rslora": True,
    }
    assert TrainConfig(lora={"r": 2, "alpha": 4, "target_modules": "q_proj"}).lora["lora_alpha"] == 4
    with pytest.raises(ConfigError, match=r"lora.use_dora=True is refused"):
        TrainConfig(lora={"target_modules": ["q_proj"], "use_dora": True})
    with pytest.raises(ConfigError, match=r"lora.init_lora_weights='pissa' is refused: it rewrites the base"):
        TrainConfig(lora={"target_modules": ["q_proj"], "init_lora_weights": "pissa"})
    with pytest.raises(ConfigError, match=r"lora has unknown fields \['ranks'\]"):
        TrainConfig(lora={"target_modules": ["q_proj"], "ranks": 3})
    with pytest.raises(
        ConfigError, match=r"as peft says: `layers_to_transform` cannot be used when `target_modules` is a str"
    ):
        TrainConfig(lora={"target_modules": "q_proj", "layers_to_transform": [0]})


OPTIONS = {
    "regex-rslora-bias-saved-head": dict(
        r=4,
        lora_alpha=8,
        target_modules=r".*\.(q_proj|v_proj)",
        use_rslora=True,
        bias="lora_only",
        alpha_pattern={"q_proj": 16},
        modules_to_save=["lm_head"],
    ),
    "all-linear-excluded-layers-patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules="all-linear",
        exclude_modules=["o_proj"],
        bias="all",
        init_lora_weights="gaussian",
    ),
    "layers-ranks-zero-init": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"v_proj": 2},
        layers_to_transform=[0, 2],
        layers_pattern="layers",
        init_lora_weights=False,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_peft_option_means_what_peft_means(ray_session, tmp_path, option):
    """peft's own model with the same LoraConfig, from raypipe's first adapters, trains alike; the
    saved adapters are peft's (same keys, same config) and give raypipe's logits in peft."""
    import json
    import warnings

    from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    directory = save_tiny("llama", str(tmp_path / "model"), attention_bias=True, mlp_bias=True)
    config = TrainConfig(
        pp=2, microbatches=2, optimizer=SGD, lora=OPTIONS[option], cpus_per_actor=0.25, threads_per_actor=1
    )
    x, _ = lm_batch(9)
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        t.save_adapter(str(tmp_path / "first"))
        losses = [t.step(*lm_batch(k))["loss"] for k in range(3)]
        t.save_adapter(str(tmp_path / "trained"))
        trained = t.predict(x)
    first = load_file(str(tmp_path / "first" / "adapter_model.safetensors"))

    def prepare(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, lora_peft_config(config.lora))
        assert not set_peft_model_state_dict(model, first).unexpected_keys
        return model

    reference = hf_reference(directory, prepare=prepare)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=4e-5)
    ours = load_file(str(tmp_path / "trained" / "adapter_model.safetensors"))
    peft_model = prepare(load(directory))
    assert set(ours) == set(get_peft_model_state_dict(peft_model))  # what peft saves, and no more
    saved_config = json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    assert saved_config["use_rslora"] == OPTIONS[option].get("use_rslora", False)
    assert saved_config["bias"] == OPTIONS[option].get("bias", "none")
    reloaded = PeftModel.from_pretrained(load(directory), str(tmp_path / "trained"))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**x).logits, trained, rtol=1e-5, atol=1e-5)


def lora_peft_config(lora):
    from raypipe.nn.lora import peft_config

    return peft_config(lora)


@pytest.mark.slow
def test_a_lora_checkpoint_holds_adapters_only_and_resumes_at_another_pp(ray_session, saved, tmp_path):
    import json

    directory = saved["llama"]
    config = TrainConfig(
        pp=2, microbatches=2, optimizer=SGD, lora=lora("llama"), cpus_per_actor=0.25, threads_per_actor=1, seed=4
    )
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        uninterrupted = [t.step(*lm_batch(k))["loss"] for k in range(4)]
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        for k in range(2):
            t.step(*lm_batch(k))
        where = t.save(str(tmp_path / "ckpt"))
    from raypipe.checkpoint import layout as ckpt

    meta = json.loads((where / ckpt.META).read_text())
    assert meta["base"]["path"] == directory and len(meta["base"]["hash"]) == 16
    held = [k for f in where.glob("model/*.safetensors") for k in ckpt.load_tensors(f)]
    assert held and all(".lora_" in k for k in held)  # adapters only: the base stays in its directory
    with Trainer(hf.from_pretrained(directory), config=config.replace(pp=3)) as t:
        t.load(str(where))
        resumed = [t.step(*lm_batch(k))["loss"] for k in range(2, 4)]
    assert resumed == pytest.approx(uninterrupted[2:], rel=1e-5)
    other = save_tiny("llama", str(tmp_path / "other"), seed=1)
    with Trainer(hf.from_pretrained(other), config=config) as t:
        with pytest.raises(Exception, match="was saved by a run on base .* but this trainer's is"):
            t.load(str(where))


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["nf4", "int8"])
def test_qlora_stores_the_base_in_fewer_bits_and_matches_peft_on_the_same_quantized_model(
    ray_session, saved, tmp_path, bits
):
    pytest.importorskip("bitsandbytes")
    from peft import get_peft_model, set_peft_model_state_dict

    from raypipe.nn.lora import peft_config, quantize

    directory = saved["llama"]
    config = TrainConfig(
        pp=2, microbatches=2, optimizer=SGD, lora=lora("llama"), quantize=bits, cpus_per_actor=0.25, threads_per_actor=1
    )
    with Trainer(hf.from_pretrained(directory), config=config) as t:
        info = t.stage_info()
        full = sum(p.numel() * 4 for p in load(directory).model.layers.parameters())
        held = sum(i["parameter_bytes"] for i in info) - 2 * sum(
            p.numel() * 4 for p in load(directory).model.embed_tokens.parameters()
        )
        assert held < full / (2 if bits == "nf4" else 1.5)  # the decoder layers' linears in 4 or 8 bits
        initial = {k: v for k, v in t.state_dict().items() if ".lora_" in k}
        names = adapters.peft_names(list(initial), hf.from_pretrained(directory).exporter.prefixes(t.specs))
        losses = [t.step(*lm_batch(k))["loss"] for k in range(3)]
        final = {names[k]: v for k, v in t.state_dict().items() if k in initial}
        x, _ = lm_batch(5)
        predicted = t.predict(x)
        merged = load(str(t.save_pretrained(str(tmp_path / "merged"), merge_adapters=True)))
    reference = load(directory)
    for layer in reference.model.layers:
        quantize(layer, bits)
    reference = get_peft_model(reference, peft_config(lora("llama")))
    set_peft_model_state_dict(reference, {names[k]: v for k, v in initial.items()})
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    expected = []
    for k in range(3):
        opt.zero_grad()
        loss = reference(**lm_batch(k)[0], labels=lm_batch(k)[1]).loss
        loss.backward()
        expected.append(loss.item())
        opt.step()
    assert losses == pytest.approx(expected, rel=1e-5)
    ref_final = {n.replace(".default.", "."): p for n, p in reference.named_parameters() if p.requires_grad}
    assert_close_dicts(final, ref_final)
    # the export holds the dequantized base with the adapters merged in; LLM.int8's forward also
    # rounds the activations to 8 bits, which a dense model does not (0.1% of the logits' scale here)
    tolerance = 1e-4 if bits == "nf4" else 1e-2
    with torch.no_grad():
        torch.testing.assert_close(merged(**x).logits, predicted, rtol=tolerance, atol=tolerance)


def test_quantize_is_refused_where_bitsandbytes_has_no_kernels_naming_the_stage():
    with pytest.raises(
        ConfigError,
        match=r"stage 1 runs on mps, where bitsandbytes has no nf4 kernels: .*"
        r"quantize: \[nf4, null\]",
    ):
        TrainConfig(pp=2, devices=["cuda", "mps"], lora=lora("llama"), quantize="nf4")
    assert TrainConfig(pp=2, devices=["cuda", "mps"], lora=lora("llama"), quantize=["nf4", None]).quantize == [
        "nf4",
        None,
    ]
    with pytest.raises(ConfigError, match="only LoRA leaves frozen"):
        TrainConfig(quantize="int8")


@pytest.mark.slow
def test_lora_on_a_bf16_base_matches_peft_and_keeps_adapters_in_fp32_as_peft_does(ray_session, saved):
    """A bf16 transformers model under LoRA at pp = 2: peft keeps the adapters in fp32
    (`autocast_adapter_dtype`) over the bf16 base, and so does raypipe; losses, adapter gradients
    and adapters after 3 steps match peft on the whole model in one process."""
    from peft import get_peft_model, set_peft_model_state_dict

    from raypipe.nn.lora import peft_config

    directory = saved["llama"]
    model = hf.from_pretrained(directory, dtype="bf16")
    config = TrainConfig(
        pp=2, microbatches=1, optimizer=SGD, lora=lora("llama"), cpus_per_actor=0.25, threads_per_actor=1
    )
    with Trainer(model, config=config) as t:
        start = t.state_dict()
        initial = {k: v for k, v in start.items() if ".lora_" in k}
        assert {v.dtype for v in initial.values()} == {torch.float32}
        assert {v.dtype for k, v in start.items() if k not in initial} == {torch.bfloat16}
        assert all(i["optimizer_state_bytes"] == 0 for i in t.stage_info())  # no fp32 masters for fp32 adapters
        names = adapters.peft_names(list(initial), model.exporter.prefixes(t.specs))
        losses, grads = [], None
        for k in range(3):
            losses.append(t.step(*lm_batch(k))["loss"])
            grads = grads if grads is not None else t.gradients()
        final = t.state_dict()
    reference = get_peft_model(load(directory).to(torch.bfloat16), peft_config(lora("llama")))
    set_peft_model_state_dict(reference, {names[k]: v for k, v in initial.items()})
    opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    expected, ref_grads = [], None
    for k in range(3):
        opt.zero_grad()
        loss = reference(**lm_batch(k)[0], labels=lm_batch(k)[1]).loss
        loss.backward()
        expected.append(loss.item())
        if ref_grads is None:
            ref_grads = {
                n.replace(".default.", "."): p.grad.clone()
                for n, p in reference.named_parameters()
                if p.grad is not None
            }
        opt.step()
    ref_final = {n.replace(".default.", "."): p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert losses == pytest.approx(expected, rel=1e-6)
    assert_close_dicts({names[k]: v for k, v in grads.items()}, ref_grads)
    assert_close_dicts({names[k]: final[k] for k in initial}, ref_final)
    assert all(torch.equal(final[k], v) for k, v in start.items() if k not in initial)  # base bit-identical
