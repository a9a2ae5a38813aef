"""TrainConfig: validation on construction, YAML with sections, overrides, fuzzing."""

import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe import ConfigError, TrainConfig
from raypipe.config import apply_overrides
from raypipe.job import JobConfig


def test_defaults_are_valid_and_printable():
    cfg = TrainConfig()
    assert cfg.pp == 1 and cfg.schedule == "1f1b"
    assert yaml.safe_load(str(cfg))["optim"]["optimizer"] == {"name": "adamw", "lr": 1e-3}


def test_a_closed_choice_is_the_fields_type_and_what_validation_accepts():
    """Each field that names one of a closed set of values carries it as a `Literal` (an editor
    completes it); validation accepts exactly those values and names them when refusing another."""
    import typing

    from raypipe.config.sections import SECTION_TYPES

    hints = {name: typing.get_type_hints(kind)[name] for kind in SECTION_TYPES.values() for name in kind.names()}
    assert set(hints) == set(TrainConfig.field_names())  # every field is typed in its section
    fields = ("partition", "same_node_transport", "device_links", "precision", "boundary_dtype", "placement")
    fields += ("nonfinite", "compress_activations", "compress_gradients")
    for name in fields:
        assert typing.get_origin(hints[name]) is typing.Literal, name
        choices = typing.get_args(hints[name])
        assert all(getattr(TrainConfig(**{name: c}), name) == c for c in choices)
        with pytest.raises(ConfigError, match=f"{name}='nope' is invalid: choose one of {', '.join(choices)}"):
            TrainConfig(**{name: "nope"})


def test_every_field_is_in_one_section_and_the_sections_read_back():
    from raypipe.config import SECTIONS

    listed = [name for names in SECTIONS.values() for name in names]
    assert sorted(listed) == sorted(TrainConfig.field_names())  # each field once, none left out
    assert not set(SECTIONS) & set(listed)  # a section named as a field could not be reached
    cfg = TrainConfig(pp=2, microbatches=4, checkpoint_dir="ck", checkpoint_every=5, loggers=[])
    assert cfg.parallel.pp == 2 and cfg.pipeline.microbatches == 4 and cfg.pipeline.schedule == "1f1b"
    assert dict(cfg.checkpoint)["checkpoint_every"] == 5 and cfg.recovery.max_restarts == 0
    assert TrainConfig.from_dict(yaml.safe_load(str(cfg))) == cfg  # the printout, in sections, reads back
    with pytest.raises(AttributeError, match="its fields: pp, dp"):
        _ = cfg.parallel.microbatches
    with pytest.raises(AttributeError, match="read-only"):
        cfg.parallel.pp = 3
    with pytest.raises(AttributeError, match="no field or section 'paralel'"):
        _ = cfg.paralel


def test_sections_are_frozen_typed_dataclasses_that_build_the_config_and_check_their_own_fields():
    """A section is a value of its own (`ParallelConfig(pp=2)`), checked when it is built; a config takes
    whole sections, mappings of a section's fields or flat fields, refuses a field given twice, copies and
    pickles whole, and is read-only with an error that says how to change it."""
    import inspect
    import pickle

    from raypipe import ParallelConfig, PipelineConfig
    from raypipe.config.sections import SECTION_TYPES, Section

    parallel = ParallelConfig(pp=2, dp=2, shard_plan=((0, 1), (1, 3)))
    assert parallel.shard_plan == [[0, 1], [1, 3]]  # a section normalises its own fields
    with pytest.raises(ConfigError, match="TrainConfig.ep=3 is invalid: expert-parallel ranks"):
        ParallelConfig(dp=2, ep=3)  # checked with no config around it
    cfg = TrainConfig(parallel=parallel, pipeline={"microbatches": 4}, seed=3)
    assert (cfg.pp, cfg.dp, cfg.microbatches, cfg.seed, cfg.parallel is parallel) == (2, 2, 4, 3, True)
    assert cfg == TrainConfig(pp=2, dp=2, shard_plan=[[0, 1], [1, 3]], microbatches=4, seed=3)
    assert isinstance(cfg.pipeline, PipelineConfig) and all(isinstance(getattr(cfg, s), Section) for s in SECTION_TYPES)
    with pytest.raises(ConfigError, match="set both by name and in the whole section parallel"):
        TrainConfig(parallel=parallel, dp=1)
    with pytest.raises(ConfigError, match="'microbatches' .a field of section 'pipeline'."):
        TrainConfig(parallel={"pp": 2, "microbatches": 4})
    with pytest.raises(ConfigError, match="unknown field 'microbatch'.*Did you mean 'microbatches'"):
        TrainConfig(microbatch=4)
    with pytest.raises(ConfigError, match="shard_plan.*it has 2 ranges but pp=3"):  # checked across sections
        cfg.replace(pp=3)
    wider = cfg.replace(parallel=ParallelConfig(pp=2, dp=4), microbatches=2)
    assert (wider.dp, wider.microbatches, wider.shard_plan, cfg.dp) == (4, 2, None, 2)
    assert pickle.loads(pickle.dumps(cfg)) == cfg and pickle.loads(pickle.dumps(cfg)).pp == 2
    with pytest.raises(AttributeError, match=r"read-only \(TrainConfig.pp\): use config.replace\(pp=...\)"):
        cfg.pp = 4
    with pytest.raises(AttributeError, match="read-only"):
        cfg.parallel = parallel
    from raypipe.config.sections import SECTION_OF, Alias

    aliases = {name: a.section for name, a in vars(TrainConfig).items() if isinstance(a, Alias)}
    assert aliases == SECTION_OF  # every field has its flat name, reading the section it lives in
    keywords = inspect.signature(TrainConfig).parameters  # what help() and a notebook show
    assert keywords["pp"].default == 1 and keywords["optimizer"].default == {"name": "adamw", "lr": 1e-3}
    assert list(keywords)[-len(SECTION_TYPES) :] == list(SECTION_TYPES)
    assert TrainConfig(quantize="nf4", lora={"target_modules": "all-linear"}, pp=2).quantize == ["nf4", "nf4"]


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("pp", 0, "TrainConfig.pp=0"),
        ("pp", 2.5, "whole number"),
        ("microbatches", -1, "TrainConfig.microbatches=-1"),
        ("schedule", "1f1bb", "Did you mean '1f1b'"),
        ("partition", "params", "Did you mean 'parameters'"),
        ("precision", "fp8", "fp32, bf16, fp16"),
        ("compress_activations", "fp8row", "Did you mean 'fp8-row'"),
        ("compress_gradients", "int4", "none, fp8, fp8-row, int8"),
        ("probe_links", "yes", "TrainConfig.probe_links='yes'"),
        ("elastic", True, "set max_restarts >= 1"),
        ("restore_from_replicas", "yes", "give true or false"),
        ("min_pp", 2, "give at most pp=1"),
        ("replace_wait", 0, "TrainConfig.replace_wait=0"),
        ("grad_clip", -1.0, "grad_clip"),
        ("optimizer", {"name": "sgdd", "lr": 0.1}, "Did you mean 'sgd'"),
        ("optimizer", {"name": "sgd"}, "learning rate"),
        ("optimizer", {"name": "sgd", "lr": 0.1, "momentun": 0.9}, "Did you mean 'momentum'"),
        ("lr_schedule", {"name": "cosine"}, "total_steps"),
        ("lr_schedule", {"name": "constant", "warmup": 3}, "Did you mean 'warmup_steps'"),
        ("activation_checkpointing", "yes", "true or false"),
        ("compile", "yes", "true or false"),
        ("actor_steps", -1, "TrainConfig.actor_steps=-1"),
        ("seed", -3, "seed"),
        ("step_timeout", 0, "step_timeout"),
        ("grad_clip", float("nan"), "finite number > 0"),
        ("optimizer", {"name": "sgd", "lr": float("inf")}, "optimizer.lr=inf"),
    ],
)
def test_bad_values_name_field_value_and_fix(field, value, words):
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{field: value})
    assert words in str(info.value)


def test_shard_plan_length_must_match_pp():
    with pytest.raises(ConfigError, match="2 ranges but pp=3"):
        TrainConfig(pp=3, shard_plan=[[0, 2], [2, 4]])


def test_compile_is_refused_where_a_layer_runs_collectives_or_bitsandbytes():
    for fields, named in (
        ({"tp": 2}, "tp=2"),
        ({"dp": 2, "ep": 2}, "ep=2"),
        ({"dp": 2, "zero": 3}, "zero=3"),
        ({"quantize": "nf4", "lora": {"r": 4, "target_modules": ["q_proj"]}}, "quantize='nf4'"),
    ):
        with pytest.raises(ConfigError, match=f"{named}.*compile=True is not supported with it yet"):
            TrainConfig(compile=True, **fields)


def test_yaml_sections_and_suggestions(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "parallel: {pp: 2, microbatches: 4, schedule: gpipe}\n"
        "optim:\n  optimizer: {name: sgd, lr: 0.1, momentum: 0.9}\n  grad_clip: 1.0\n"
        "seed: 3\nmodel: {n_layer: 2}\n"
    )
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.pp, cfg.microbatches, cfg.schedule, cfg.seed, cfg.grad_clip) == (2, 4, "gpipe", 3, 1.0)
    assert cfg.optimizer == {"name": "sgd", "lr": 0.1, "momentum": 0.9}
    path.write_text("parallel: {pp: 2, microbatch: 4}\n")
    with pytest.raises(ConfigError, match="parallel.microbatch.*Did you mean 'microbatches'"):
        TrainConfig.from_yaml(path)
    path.write_text("shedule: gpipe\n")
    with pytest.raises(ConfigError, match="Did you mean 'schedule'"):
        TrainConfig.from_yaml(path)
    path.write_text("pp: 2\nparallel: {pp: 3}\n")
    with pytest.raises(ConfigError, match="set twice"):
        TrainConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")


def test_overrides_reach_fields_inside_sections(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("parallel: {pp: 2, microbatches: 4}\nmodel: {n_layer: 2}\n")
    cfg = TrainConfig.from_yaml(path, ["microbatches=8", "shard_plan=[[0,1],[1,3]]"])
    assert cfg.microbatches == 8 and cfg.shard_plan == [[0, 1], [1, 3]]
    raw = apply_overrides({"model": {"n_layer": 2}}, ["model.n_layer=6", "optimizer.lr=0.5"])
    assert raw == {"model": {"n_layer": 6}, "optimizer": {"lr": 0.5}}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["microbatches"])


def test_replace_revalidates():
    cfg = TrainConfig(pp=2)
    assert cfg.replace(microbatches=4).microbatches == 4
    with pytest.raises(ConfigError, match="microbatches"):
        cfg.replace(microbatches=0)
    with pytest.raises(ConfigError, match="Did you mean 'schedule'"):
        cfg.replace(schedul="gpipe")


def test_job_files_in_examples_load():
    for name in ("gpt_pp2", "tiny"):
        job = JobConfig.from_yaml(f"examples/configs/{name}.yaml")
        assert job.train.pp == 2 and job.model.config.n_embd % job.model.config.n_head == 0


def test_job_sections_reject_unknown_keys(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("model: {n_layers: 2}\n")
    with pytest.raises(ConfigError, match="model.n_layers.*Did you mean 'n_layer'"):
        JobConfig.from_yaml(path)
    path.write_text("model: {n_embd: 30, n_head: 4}\n")
    with pytest.raises(ConfigError, match="n_head=4"):
        JobConfig.from_yaml(path)


values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 40),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.lists(st.integers(-2, 10), max_size=3), max_size=4),
    st.dictionaries(
        st.sampled_from(["name", "lr", "momentum", "warmup_steps", "total_steps", "x"]),
        st.one_of(st.text(max_size=6), st.floats(allow_nan=True), st.integers(-3, 9)),
        max_size=4,
    ),
)
keys = st.sampled_from(list(TrainConfig.field_names()) + ["parallel", "optim", "shedule", "model"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, values, max_size=6))
def test_fuzzed_configs_are_valid_or_config_errors(data):
    try:
        cfg = TrainConfig.from_dict(data)
    except ConfigError:
        return
    assert cfg.pp >= 1 and cfg.microbatches >= 1
    assert cfg.grad_clip is None or (cfg.grad_clip > 0 and not math.isnan(cfg.grad_clip))


def test_scientific_numbers_in_yaml_and_overrides_are_floats_and_dotted_keys_find_their_section(tmp_path):
    """PyYAML reads `3e-4` as a string (YAML 1.1 wants `3.0e-4`); a learning rate written so is a float
    here, in the file and in `--set`; and `optimizer.lr=...` reaches the optimizer kept in an `optim` section."""
    path = tmp_path / "job.yaml"
    path.write_text("optim:\n  optimizer: {name: adamw, lr: 3e-4}\n  grad_clip: 1e0\nparallel: {pp: 2}\n")
    assert TrainConfig.from_yaml(path).optimizer == {"name": "adamw", "lr": 3e-4}
    cfg = TrainConfig.from_yaml(path, ["optimizer.lr=1e-5", "grad_clip=2E+0"])
    assert cfg.optimizer == {"name": "adamw", "lr": 1e-5} and cfg.grad_clip == 2.0 and cfg.pp == 2
    assert apply_overrides({"a": {"b": 1}}, ["b=1_000", "name=1e", "c=.5"]) == {
        "a": {"b": 1000},
        "name": "1e",
        "c": 0.5,
    }


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_a_config_with_python_objects_always_records_as_json_and_yaml():
    """Issue 74.1: a GRPO config holding reward functions as callables (the documented Python API)
    and a tokenizer object (what the job passes) recorded in every checkpoint's manifest: it failed
    at the first save, after the actors wrote their files. A function records as its import path,
    which a YAML config reads back; a lambda as what it is; a tokenizer as its directory."""
    import json

    class Tokenizer:
        name_or_path = "runs/llama_pp2/hf"

        def batch_decode(self, ids):
            return ["" for _ in ids]

    rewards = [_reward, lambda completions, **kwargs: [0.0] * len(completions), "json:dumps"]
    objective = {"name": "grpo", "num_generations": 2, "reward_funcs": rewards, "tokenizer": Tokenizer()}
    config = TrainConfig(objective=objective)
    recorded = json.loads(json.dumps(config.to_dict()))["objective"]
    assert recorded["reward_funcs"] == [
        f"{__name__}:_reward",
        "<<lambda>: a Python callable, not recorded>",
        "json:dumps",
    ]
    assert recorded["tokenizer"] == "runs/llama_pp2/hf"
    assert yaml.safe_load(str(config))["optim"]["objective"]["reward_funcs"][0] == f"{__name__}:_reward"
    assert config.objective["reward_funcs"][0] is _reward  # the config itself keeps the callables


def test_an_objective_with_zero3_is_refused_naming_both_settings():
    """Issue 74.3: DPO or GRPO with zero=3 at dp 2 was accepted, then every actor segfaulted in the
    reference capture (a layer's storage is empty between steps under ZeRO-3)."""
    for name in ("dpo", "kto", "grpo"):
        with pytest.raises(ConfigError, match=r"TrainConfig.zero=3 is invalid: TrainConfig.objective's reference"):
            TrainConfig(dp=2, zero=3, objective={"name": name}, lora={"r": 4, "target_modules": ["q_proj"]})
