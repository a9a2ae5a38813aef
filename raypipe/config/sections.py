"""`TrainConfig`'s fields in sections, as torchtitan's JobConfig groups its own: what each
section decides, for the guide's table, a config's printout and `config.<section>.<field>`.
A section is never named as a field is (`config.pipeline.schedule`, `config.numerics.precision`).
The flat names stay the config's own: `TrainConfig(pp=2)`, `--set pp=2` and a YAML file's
`pp: 2`, at the top or under any section (`parallel: {pp: 2}`), all keep working."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

SECTIONS: dict[str, tuple[str, ...]] = {
    "parallel": ("pp", "dp", "tp", "ep", "zero", "dp_bucket_mb", "shard_plan", "partition"),
    "pipeline": ("microbatches", "schedule", "chunks", "extra_warmup", "sequence_chunks", "engine", "actor_steps"),
    "optim": ("optimizer", "lr_schedule", "grad_clip", "objective", "nonfinite", "seed"),
    "numerics": (
        "precision",
        "boundary_dtype",
        "compress_activations",
        "compress_gradients",
        "activation_checkpointing",
        "compile",
        "measure_activations",
    ),
    "adapters": ("lora", "quantize"),
    "checkpoint": ("checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume"),
    "recovery": (
        "max_restarts",
        "restore_from_replicas",
        "elastic",
        "min_pp",
        "min_dp",
        "replace_wait",
        "step_timeout",
    ),
    "cluster": (
        "devices",
        "gpus_per_actor",
        "allow_cpu_fallback",
        "cpus_per_actor",
        "threads_per_actor",
        "actor_start_timeout",
        "placement",
        "same_node_transport",
        "probe_links",
        "device_links",
    ),
    "observe": ("name", "log_dir", "loggers"),
}
SECTION_OF: dict[str, str] = {name: section for section, names in SECTIONS.items() for name in names}


class SectionView(Mapping):
    """One section of a config, read-only: `config.parallel.pp`, `dict(config.parallel)`."""

    def __init__(self, config: Any, section: str) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_names", SECTIONS[section])
        object.__setattr__(self, "_section", section)

    def __getattr__(self, name: str) -> Any:
        if name in self._names:
            return getattr(self._config, name)
        raise AttributeError(f"section {self._section!r} has no field {name!r}; its fields: {', '.join(self._names)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a config section is read-only: use config.replace({name}=...) or Trainer.reconfigure")

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        return getattr(self._config, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"{self._section}({', '.join(f'{k}={self[k]!r}' for k in self)})"
