"""`TrainConfig`: the typed, validated description of how a model is trained.

Its fields live in nine typed sections (`raypipe.config.sections`), read by their flat names too
(`config.pp`). Every field is checked when the config is built, and a bad value raises
`ConfigError` naming the field, the value and the fix. YAML files may group fields in sections
(`parallel: {pp: 2}`, the config's sections or any other name); the field names stay the same.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raypipe.checkpoint.storage import redact_values
from raypipe.config.checks import plain
from raypipe.config.choices import (
    BoundaryDtype,
    DeviceLinks,
    NonfinitePolicy,
    Partition,
    Placement,
    Precision,
    SameNodeTransport,
)
from raypipe.config.loggers import LoggerEntry
from raypipe.config.sections import (
    SECTION_OF,
    SECTIONS,
    AdaptersConfig,
    Alias,
    CheckpointConfig,
    ClusterConfig,
    NumericsConfig,
    ObserveConfig,
    OptimConfig,
    ParallelConfig,
    PipelineConfig,
    RecoveryConfig,
)
from raypipe.config.sections.base import refuse_change
from raypipe.config.sections.flat import build_sections, config_signature
from raypipe.config.settings import LoraSettings, LrScheduleSettings, ObjectiveSettings, OptimizerSettings
from raypipe.config.validation import RECONFIGURABLE, check_across
from raypipe.core.errors import ConfigError, nearest
from raypipe.transport.compress import Codec

# Sections of a job file that belong to the job, not to TrainConfig (see raypipe.job).
JOB_SECTIONS = ("model", "data", "job")


@dataclass(frozen=True, init=False)
class TrainConfig:
    """How a model is split and trained: nine sections of typed, checked fields.

    Built from flat keywords (`TrainConfig(pp=2, microbatches=4)`), from sections
    (`TrainConfig(parallel=ParallelConfig(pp=2))` or `parallel={"pp": 2}`), or both for different
    sections. Each section checks its own fields when it is built; the config then checks what
    spans sections (`validation.check_across`). Every error names the field, the value and the fix.
    Read-only: `replace` makes a changed copy, `Trainer.reconfigure` changes a running trainer's.

    Attributes:
        parallel: how the model and the batch are split across actors (`ParallelConfig`).
        pipeline: how a step runs through the stages: schedule, microbatches, engine (`PipelineConfig`).
        optim: the optimizer, its schedule and the objective (`OptimConfig`).
        numerics: dtypes, compression, recomputation and compiling (`NumericsConfig`).
        adapters: LoRA and a quantized base (`AdaptersConfig`).
        checkpoint: where checkpoints go and whether the run resumes (`CheckpointConfig`).
        recovery: restarts, elastic shrinking and timeouts (`RecoveryConfig`).
        cluster: devices, reservations, placement and links (`ClusterConfig`).
        observe: the run's name and its loggers (`ObserveConfig`).
    """

    parallel: ParallelConfig
    pipeline: PipelineConfig
    optim: OptimConfig
    numerics: NumericsConfig
    adapters: AdaptersConfig
    checkpoint: CheckpointConfig
    recovery: RecoveryConfig
    cluster: ClusterConfig
    observe: ObserveConfig

    # The flat names: `config.pp` reads `config.parallel.pp` (the section's docstring says what each means).
    pp = Alias[int]("parallel")
    dp = Alias[int]("parallel")
    tp = Alias[int]("parallel")
    ep = Alias[int]("parallel")
    zero = Alias[int]("parallel")
    dp_bucket_mb = Alias[float]("parallel")
    shard_plan = Alias[list[list[int]] | None]("parallel")
    partition = Alias[Partition]("parallel")
    microbatches = Alias[int]("pipeline")
    schedule = Alias[str]("pipeline")
    chunks = Alias[int | None]("pipeline")
    extra_warmup = Alias[int | None]("pipeline")
    sequence_chunks = Alias[int | str]("pipeline")
    engine = Alias[str]("pipeline")
    actor_steps = Alias[int | str]("pipeline")
    optimizer = Alias[OptimizerSettings]("optim")
    lr_schedule = Alias[LrScheduleSettings]("optim")
    grad_clip = Alias[float | None]("optim")
    objective = Alias[ObjectiveSettings | None]("optim")
    nonfinite = Alias[NonfinitePolicy]("optim")
    seed = Alias[int]("optim")
    precision = Alias[Precision]("numerics")
    boundary_dtype = Alias[BoundaryDtype]("numerics")
    compress_activations = Alias[Codec]("numerics")
    compress_gradients = Alias[Codec]("numerics")
    activation_checkpointing = Alias[bool]("numerics")
    compile = Alias[bool]("numerics")
    measure_activations = Alias[bool]("numerics")
    lora = Alias[LoraSettings | None]("adapters")
    quantize = Alias[str | list[str | None] | None]("adapters")
    checkpoint_dir = Alias[str | None]("checkpoint")
    checkpoint_every = Alias[int]("checkpoint")
    keep_checkpoints = Alias[int]("checkpoint")
    resume = Alias[bool | int]("checkpoint")
    max_restarts = Alias[int]("recovery")
    restore_from_replicas = Alias[bool]("recovery")
    elastic = Alias[bool]("recovery")
    min_pp = Alias[int]("recovery")
    min_dp = Alias[int]("recovery")
    replace_wait = Alias[float]("recovery")
    step_timeout = Alias[float]("recovery")
    devices = Alias[str | list[str]]("cluster")
    gpus_per_actor = Alias[float]("cluster")
    allow_cpu_fallback = Alias[bool]("cluster")
    cpus_per_actor = Alias[float | None]("cluster")
    threads_per_actor = Alias[int | None]("cluster")
    actor_start_timeout = Alias[float]("cluster")
    placement = Alias[Placement]("cluster")
    same_node_transport = Alias[SameNodeTransport]("cluster")
    probe_links = Alias[bool]("cluster")
    device_links = Alias[DeviceLinks]("cluster")
    name = Alias[str | None]("observe")
    log_dir = Alias[str | None]("observe")
    loggers = Alias[list[LoggerEntry]]("observe")

    def __init__(self, **values: object) -> None:
        """`values`: fields by their flat names, or whole sections (a section or a mapping of its
        fields) by their section names; a section not given is built from its flat fields."""
        for name, built in build_sections(values).items():
            object.__setattr__(self, name, built)
        for name, normalised in check_across(self).items():  # raises ConfigError naming the field, the value, the fix
            section = SECTION_OF[name]
            object.__setattr__(self, section, getattr(self, section).with_values(**{name: normalised}))

    def __getattr__(self, name: str) -> object:
        """Only for a name the config lacks: the error names the nearest field."""
        if name.startswith("__"):
            raise AttributeError(name)
        names = (*SECTIONS, *SECTION_OF)
        raise AttributeError(f"TrainConfig has no field or section {name!r}.{nearest(name, names)}")

    def num_chunks(self) -> int:
        """Model chunks per actor: the schedule's own, or `chunks` where it lets the config choose
        (1 for "auto" until the trainer has chosen)."""
        return self.pipeline.num_chunks()

    def stage_kinds(self) -> list[str]:
        """The accelerator kind of each stage (`devices` given once for all, or per stage)."""
        return [self.devices] * self.pp if isinstance(self.devices, str) else list(self.devices)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field's flat name, section by section."""
        return tuple(SECTION_OF)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> TrainConfig:
        """Builds a config from a mapping whose fields may be grouped in sections.

        A key that is a field name sets that field; any other key whose value is a
        mapping is a section, whose keys are field names. The job sections `model`,
        `data` and `job` are skipped (they configure `raypipe.job`, not training).

        Raises:
            ConfigError: for an unknown key (with the nearest valid name), a field set
                twice, or a bad value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"a training config must be a mapping of fields, got {type(data).__name__}")
        names = cls.field_names()
        flat: dict[str, object] = {}
        for key, value in data.items():
            if key in JOB_SECTIONS:
                continue
            if key in names:
                entries = {key: value}
            elif isinstance(value, Mapping):
                entries = dict(value)
                for sub in entries:
                    if sub not in names:
                        raise ConfigError(
                            f"unknown field {key}.{sub}: TrainConfig has no field {sub!r}.{nearest(str(sub), names)}"
                        )
            else:
                raise ConfigError(f"unknown field {key!r}: TrainConfig has no such field.{nearest(str(key), names)}")
            for name, v in entries.items():
                if name in flat:
                    raise ConfigError(f"field {name!r} is set twice; keep one.")
                flat[name] = v
        return cls(**flat)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Iterable[str] = ()) -> TrainConfig:
        """Loads a config from a YAML file, then applies `key=value` overrides."""
        return cls.from_dict(apply_overrides(load_yaml(path), overrides))

    def to_dict(self) -> dict[str, object]:
        """The fields by their flat names as plain values (`checks.plain`: a function as its import path),
        for records and display: a URI's secret shows as `***` (`storage.redact`), never leaked into a
        record or a print."""
        return redact_values(plain({name: getattr(self, name) for name in self.field_names()}))

    def replace(self, **changes: object) -> TrainConfig:
        """A copy with some fields (by their flat names) or whole sections changed, checked like a new config."""
        values: dict[str, object] = {name: getattr(self, name) for name in SECTIONS}
        for key, value in changes.items():
            if key in SECTIONS:
                values[key] = value
            elif key in SECTION_OF:
                section = SECTION_OF[key]
                current = values[section]
                values[section] = {**(current if isinstance(current, Mapping) else {}), key: value}
            else:
                raise ConfigError(f"unknown field {key!r}.{nearest(key, self.field_names())}")
        return TrainConfig(**values)

    def __str__(self) -> str:
        """The fields as YAML in their sections, which `from_yaml` reads back."""
        flat = self.to_dict()
        grouped = {section: {name: flat[name] for name in names} for section, names in SECTIONS.items()}
        return yaml.safe_dump(grouped, sort_keys=False).rstrip()


TrainConfig.__setattr__ = refuse_change  # type: ignore[method-assign,assignment]
TrainConfig.__delattr__ = refuse_change  # type: ignore[method-assign,assignment]
TrainConfig.__signature__ = config_signature()  # help(TrainConfig) and a notebook's completion list the flat fields


def load_yaml(path: str | Path) -> dict[str, object]:
    """Reads a YAML mapping; a missing file or non-mapping content is a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    try:
        data = parse_yaml(path.read_text()) or {}
    except yaml.YAMLError as error:  # a syntax error: where, and what the parser expected
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{at}: {getattr(error, 'problem', None) or error}. "
            f"Fix that line (indentation, a missing ':' or quote)."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(data).__name__}.")
    return data


class _Loader(yaml.SafeLoader):
    """YAML 1.1's safe loader, reading `3e-4` as the float YAML 1.2 (and everyone) means, not a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
        r"|[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> object:
    """A config file's (or an override's) YAML, numbers like `1e-5` read as floats."""
    return yaml.load(text, Loader=_Loader)


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Applies command-line overrides like `microbatches=8` or `model.n_layer=2`.

    The value is parsed as YAML (so `8` is an int, `[[0,2],[2,4]]` a list). A dotted
    key sets a key inside a section or mapping field; a key whose first part names a field
    living inside a section of the file is set there (`optimizer.lr=3e-4` with `optim: {optimizer: ...}`).
    """
    data = dict(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value, e.g. microbatches=8.")
        key, raw = item.split("=", 1)
        value = parse_yaml(raw)
        parts = key.strip().split(".")
        target = data
        if parts[0] not in data:  # a field kept in a section: `lr` of `optim: {optimizer: {...}}` too
            for name, section in data.items():
                if isinstance(section, dict) and parts[0] in section:
                    parts = [name, *parts]
                    break
        for part in parts[:-1]:
            nxt = target.get(part)
            nxt = dict(nxt) if isinstance(nxt, dict) else {}
            target[part] = nxt
            target = nxt
        target[parts[-1]] = value
    return data


def check_reconfigurable(changes: dict[str, object], current: TrainConfig | None = None) -> None:
    """Raises ConfigError for a field that needs a new Trainer, or one TrainConfig lacks (or, against
    the `current` config, a change a running trainer cannot make: ZeRO-3 on or off)."""
    autos = [name for name in ("schedule", "sequence_chunks") if changes.get(name) == "auto"]
    if autos:  # chosen by timing the layers on a sample, which only a starting trainer does
        raise ConfigError(f"TrainConfig.{autos[0]}='auto' is chosen when a Trainer starts: give a value to change to.")
    zero = changes.get("zero", current.zero) if current is not None else None
    if current is not None and zero != current.zero and 3 in (zero, current.zero):
        raise ConfigError(
            f"TrainConfig.zero cannot switch between {current.zero} and {changes['zero']} on a running "
            "trainer (zero=3 lays the weights out anew): save a checkpoint and load it into a new Trainer."
        )
    fixed = [k for k in changes if k not in RECONFIGURABLE]
    if fixed:
        names = TrainConfig.field_names()
        if fixed[0] in names:
            raise ConfigError(
                f"TrainConfig.{fixed[0]} cannot change on a running trainer (it decides the "
                f"actors); shut this one down and build a new Trainer. Changeable: {', '.join(RECONFIGURABLE)}."
            )
        raise ConfigError(f"unknown field {fixed[0]!r}.{nearest(fixed[0], names)}")
