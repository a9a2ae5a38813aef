"""`TrainConfig`: the typed, validated description of how a model is trained.

Every field is checked when the config is built, and a bad value raises
`ConfigError` naming the field, the value and the fix. YAML files may group
fields in sections (`parallel: {pp: 2}`, the sections of `raypipe.config.sections` or any
other name); the field names stay the same.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raypipe.checkpoint.storage import redact_values
from raypipe.config.checks import plain
from raypipe.config.choices import DeviceLinks, NonfinitePolicy, Partition, Placement, Precision, SameNodeTransport
from raypipe.config.sections import SECTIONS, SectionView
from raypipe.config.validation import RECONFIGURABLE, validate
from raypipe.core.errors import ConfigError, nearest
from raypipe.schedules import SCHEDULES
from raypipe.transport.compress import Codec

# Sections of a job file that belong to the job, not to TrainConfig (see raypipe.job).
JOB_SECTIONS = ("model", "data", "job")


@dataclass
class TrainConfig:
    """How a model is split and trained.

    Attributes:
        pp: number of pipeline stages (one Ray actor each).
        dp: data-parallel replicas of the whole pipeline; the batch is split across them
            and gradients are averaged, so the result is the full batch's gradient.
        tp: tensor-parallel ranks per stage: layers that declare a `tp_plan` (the
            reference GPT does) are split across tp actors joined by collectives; layers
            without one are replicated on every tp rank.
        ep: expert-parallel ranks, carved out of the dp replicas (ep divides dp, as in Megatron
            and DeepSpeed): each MoE layer's experts (`raypipe.nn.MoE`) are split across ep
            replicas, tokens travel to their experts and back by all-to-all, and expert
            gradients are averaged only among the replicas holding the same experts.
        zero: 1 shards optimizer state across the dp replicas (ZeRO stage 1): each replica
            steps its share of the parameters and sends the result to the others; 0 off.
            Reconfigurable: switching it re-shards the optimizer state, nothing is lost.
            3 (ZeRO stage 3 / FSDP inside each stage) shards the weights, gradients and optimizer
            state too: each layer is gathered among the replicas just before its forward and
            its backward and freed after (p2p and compiled engines; not with quantize or ep;
            not switched to or from on a running trainer). Checkpoints stay whole.
        dp_bucket_mb: MiB of gradients the dp all-reduce flattens into one collective (torch
            DDP's `bucket_cap_mb`, same default): larger amortises each collective's latency.
        microbatches: microbatches each batch is split into; the batch size must divide by it.
        schedule: pipeline schedule: "1f1b" (bounded activation memory), "gpipe", "interleaved-1f1b"
            (`chunks` model chunks per actor, chunk c of actor s being virtual stage c*pp+s: the
            bubble divided by the chunks; microbatches a multiple of pp), "zb-h1" (backward split
            into input and weight gradients, the weight gradients filling the bubble, at 1F1B's
            peak memory), "zb-v" (two chunks per actor in a V, virtual stages s and 2pp-1-s:
            nearly no bubble) or "dualpipe-v" (DeepSeek's DualPipeV: zb-v's V with each forward
            paired with the other chunk's backward, communication hiding under compute; best from
            2pp microbatches). p2p and compiled engines only for the last four. "auto": the
            schedule, chunks and microbatches with the least predicted step time that fit every
            device's memory, from the layers timed on each device kind (needs `Trainer(...,
            sample=(x, y))`; prints every candidate's prediction; `raypipe.planning.autoschedule`).
        chunks: model chunks per actor for "interleaved-1f1b" (default 2); the other schedules
            fix their own (1, or 2 for "zb-v" and "dualpipe-v").
        extra_warmup: forwards each stage but the last runs ahead before its first backward,
            beyond its schedule's warm-up ("1f1b" and "zb-h1"): over a slow link the next
            microbatches' activations cross while the first one's gradient comes back, so the
            link stays busy instead of idling one round trip per microbatch. Each costs one more
            microbatch's stashed activations on those stages. 1 is enough on the links measured
            (docs/BENCHMARKS.md, "A slow link"); schedule="auto" chooses it where the links
            between stages were measured (`probe_links`).
        sequence_chunks: k > 1 cuts every sample along the sequence into k chunks that flow
            through the pipeline one after another (Seq1F1B), so one long sample fills it (m = 1
            idles (pp - 1)/pp of each step). Forwards run in chunk order, backwards in reverse;
            attention keeps earlier chunks' keys and values and their gradients: exact
            (`raypipe.nn.sequence_chunks`). "gpipe", "1f1b", "zb-h1"; GPT and transformers' families;
            token-weighted losses. With activation_checkpointing a stage keeps each chunk's input,
            keys and values, one chunk's activations at a time. "auto": the count of 1 to 16
            (>= 32 tokens each) predicted fastest from the layers timed on the sample cut each way
            (`sample=`). Not with compile, DPO or GRPO, nor a layer lacking `runs_sequence_chunks`.
        shard_plan: explicit contiguous [start, end) layer ranges, one per stage (per virtual
            stage with chunks, in virtual-stage order); overrides `partition`.
        partition: how to split layers when no shard_plan is given: "uniform" (layer count),
            "parameters" (parameter count) or "profile" (time every layer on each device
            kind of the run, then the exact split minimising the slowest stage within each
            device's memory; needs `Trainer(..., sample=(x, y))`).
        optimizer: {"name": "sgd" | "adam" | "adamw", "lr": ..., other torch.optim keywords}.
            Stages on the CPU use torch's fused kernels unless `fused` or `foreach` is given
            (AdamW steps ~2.8x faster there; "fused": False keeps torch's default).
        lr_schedule: {"name": "constant" | "cosine", "warmup_steps", "total_steps", "min_lr"}.
        grad_clip: clip gradients to this global L2 norm (across all stages); None disables.
        objective: what a step minimises. None: the loss function (a model's next-token loss).
            {"name": "dpo", "beta": 0.1, "loss_type": "sigmoid" | "hinge" | "ipo"}: direct
            preference optimisation as TRL defines it; `Trainer.step` then takes a list of pair
            records {"prompt_ids", "chosen_ids", "rejected_ids"} and measures each pair against the
            policy as the run began (its adapters, or a frozen copy of the weights; docs/preference.md).
            {"name": "grpo", "num_generations": G, "loss_type": "dapo" | "grpo" | "dr_grpo", "beta":
            0.0, "reward_funcs": [...], ...}: group
            relative policy optimisation as TRL's GRPOTrainer defines it; `Trainer.step` takes one
            generation batch {"prompt_ids", "completion_ids", "rewards"} and `fit` generates and scores
            each batch of prompts itself (docs/preference.md: every registered objective's settings).
        engine: how a step runs. "refs": the driver issues every forward and backward
            as an actor call and boundary tensors travel as Ray object references;
            "p2p": one call per actor per step with its whole action list, boundary
            tensors sent actor to actor over torch.distributed (gloo) point to point;
            "compiled": p2p's step issued through a Ray Compiled Graph (one `execute`
            per step instead of one Ray task per actor).
        actor_steps: 0: `fit` submits each step from the driver. N > 0: the actors drive runs of up to N
            steps themselves (batches from a reader actor, outcomes to a board actor the driver reads
            once per step): the driver's cost per step does not grow with the actors. p2p engine, a
            Dataset or batches(step) Ray can pickle. "auto": runs of 256 where those hold, the fit
            overlaps (no on_step, or overlap=True) and its steps x actors >= 3000 (repays the helpers).
        same_node_transport: how p2p and compiled move boundary tensors between neighbouring
            stages on one node: "shm" (shared memory and a pipe: one copy, no TCP; streams too
            large for /dev/shm fall back to gloo) or "gloo" (loopback TCP). Stages on
            different nodes always use gloo. With "shm" the step's closing agreement (global
            norm, failures) also goes through pipes when every actor is on one node.
        probe_links: measure the rate and latency each way of every link between neighbouring
            stages on different nodes when the actors start (a fraction of a second per link,
            over gloo; `Trainer.links()`, `stage_info()`). With partition="profile" or
            schedule="auto" the trainer then plans again for the measured links: the split moves
            to where boundaries are small or links fast, and "auto" picks the schedule, the
            microbatches and `extra_warmup` that hide the link (the actors restart once when
            the split or the chunks change). False: a link-blind plan, nothing measured.
        device_links: how p2p and compiled move boundary tensors between two CUDA (or ROCm)
            stages: "auto" keeps them on the device, over NCCL (RCCL), when the two stages hold
            different GPUs (on one node or not), and goes through host memory otherwise
            (NCCL refuses two ranks on one GPU); "host" always goes through host memory
            (`same_node_transport`, gloo between nodes); "nccl" puts every link on NCCL's
            in-order streams, an error where two linked stages share a GPU (on CPU and MPS
            stages those streams run over gloo: how the tests check them without a GPU).
        precision: "fp32", "bf16" (autocast) or "fp16" (autocast with dynamic loss scaling).
        boundary_dtype: the dtype activations and their gradients travel in between
            stages: "fp32" (as computed), or "bf16" / "fp16" to halve the bytes sent; the
            receiving stage computes in float32 again.
        compress_activations: send the activations between stages in 8 bits per element with a
            float32 scale, a quarter of fp32's bytes, for slow links (`raypipe.transport.compress`):
            "fp8" (e4m3, a scale per tensor), "fp8-row" (a scale per row), "int8" (a scale per
            row), or "none". Not exact: the loss it costs on the main job and a Llama is in
            docs/BENCHMARKS.md ("Narrow and compressed stage boundaries"). Vectors and scalars
            (losses, counts) stay exact.
        compress_gradients: the same for the gradients going back, separately.
        measure_activations: count the bytes autograd saves for backward per stashed
            microbatch (saved-tensor hooks; about 7 % slower forward on CPU), reported
            as `peak_stashed_bytes`. The count of stashed microbatches is always reported.
        activation_checkpointing: recompute each stage's forward during backward instead of
            keeping its intermediate activations.
        compile: torch.compile each layer on its actor (per block, as torchtitan does; inductor
            on CPU needs a C++ compiler; not engine="compiled", Ray's Compiled Graphs): the first
            steps compile (the inductor cache on disk serves the other actors), then each layer
            runs its compiled graph. Microbatches of varying length cost one recompile (dynamic
            shapes after the first change); each step's stage report counts compiled graphs and
            graph breaks (`compiled`). Under a split backward (zb-h1, zb-v, dualpipe-v) a
            compiled stage makes its weight gradients with its input gradients, at I: exact,
            without the zero-bubble gain. Reconfigurable.
        seed: seeds layer initialisation (per layer, so the same for any split) and data order.
        cpus_per_actor: logical CPUs each stage actor reserves; None fits the actors into the
            cluster's CPUs (at most 1 each).
        threads_per_actor: torch intra-op threads per actor; None shares each node's CPUs, at most
            its OS cores, among the trainer's actors there (the reservation inside a Tune trial).
        actor_start_timeout: seconds to wait for every actor to be placed and built.
        placement: how the actors are reserved, all or nothing, in one Ray placement group:
            "pack" (as few nodes as possible), "spread" (across nodes where possible) or
            "strict_spread" (one actor per node). A trainer that does not fit holds nothing
            while it waits, so two trainers on one cluster never each hold half.
        step_timeout: seconds a step may go without any action finishing before it is abandoned
            (under engine="compiled", where a step is one call per actor: seconds for the whole step).
        name: run name, used in actor names and logs; None picks a unique one.
        checkpoint_dir: where checkpoints go (`<dir>/step-N/`): a directory (shared by all nodes in
            a multi-node run) or a URI `pyarrow.fs` opens (`s3://bucket/run`; `raypipe.checkpoint.storage`).
            None disables automatic checkpoints.
        checkpoint_every: save every this many steps (0: only on `Trainer.save`).
        keep_checkpoints: how many of the run's newest checkpoints to keep (0: all; never another run's).
        resume: continue the run in `checkpoint_dir` from its newest valid checkpoint (true) or
            step N's (an int); false (a new run) refuses a directory holding another run's.
        max_restarts: how many times `Trainer.fit` rebuilds the actors after one dies,
            restoring the last checkpoint, before it gives up.
        restore_from_replicas: after a loss with dp > 1, the new actors take the surviving
            replicas' weights and optimizer state from memory when they hold the whole model
            (`raypipe.driver.run.replicas`): the failed step runs again and none is replayed. False
            (or ZeRO, or dp = 1): always the last checkpoint.
        elastic: when a node is lost and no node takes its actors within `replace_wait`, go on
            with what is left (`raypipe.driver.run.elastic`): fewer dp replicas (the global batch kept
            by more microbatches) or fewer pipeline stages (the layers split again), from the
            surviving replicas (`restore_from_replicas`) or the last checkpoint; grow back to this
            config at a checkpoint once a node joins. Needs max_restarts >= 1 (each shrink or
            failed regrowth spends one).
        min_pp: the fewest pipeline stages an elastic run may shrink to.
        min_dp: the fewest dp replicas an elastic run may shrink to.
        replace_wait: seconds an elastic run waits for a node to take a lost node's actors
            before it shrinks (part of the time from the loss to the next step).
        nonfinite: what a NaN or infinite loss or gradient does: "error" stops with an
            error naming the step, "skip" skips that update and goes on. Weights are
            never updated from non-finite gradients.
        log_dir: TensorBoard scalars (per step and stage) go here, a folder per run (docs/watching.md); None: off.
        loggers: where each step's scalars go (`raypipe.observe.loggers`): "tensorboard" (to `log_dir`),
            "mlflow", "wandb", each a name or `{name: {option: value}}`, e.g.
            `[tensorboard, {mlflow: {tracking_uri: "sqlite:///runs.db"}}]`.
        devices: the accelerator kind of every stage ("cpu", "cuda", "rocm", "mps"), or a
            list with one kind per stage. A cuda/rocm/mps stage asks Ray for that custom
            resource (and `num_gpus` for cuda/rocm) on a node labelled with the kind.
        gpus_per_actor: the share of one device each accelerator stage takes (0.5 puts
            two stages on one GPU).
        allow_cpu_fallback: let a cuda/rocm/mps stage run on the CPU when its node has
            no such device (tests and demos); the actor reports that it did.
        lora: low-rank adapters through peft: a `peft.LoraConfig` or its fields (`r`, `lora_alpha`
            or `alpha`, `target_modules` as names, a regex or "all-linear", `use_rslora`, `bias`, ...),
            each meaning what peft means (`raypipe.nn.lora`); what peft trains trains, the rest is frozen.
        quantize: QLoRA: "nf4" or "int8" stores the frozen base's linears through bitsandbytes
            (cpu, cuda, rocm stages), or one entry per stage (null keeps a stage's dtype).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    dp_bucket_mb: float = 25.0
    microbatches: int = 1
    schedule: str = "1f1b"
    chunks: int | None = None
    extra_warmup: int = 0
    sequence_chunks: int | str = 1
    shard_plan: list[list[int]] | None = None
    partition: Partition = "uniform"
    optimizer: dict = field(default_factory=lambda: {"name": "adamw", "lr": 1e-3})
    lr_schedule: dict = field(default_factory=lambda: {"name": "constant"})
    grad_clip: float | None = None
    objective: dict | None = None
    engine: str = "p2p"
    actor_steps: int | str = "auto"
    same_node_transport: SameNodeTransport = "shm"
    probe_links: bool = True
    device_links: DeviceLinks = "auto"
    precision: Precision = "fp32"
    boundary_dtype: Precision = "fp32"
    compress_activations: Codec = "none"
    compress_gradients: Codec = "none"
    activation_checkpointing: bool = False
    compile: bool = False
    measure_activations: bool = False
    seed: int = 0
    cpus_per_actor: float | None = None
    threads_per_actor: int | None = None
    actor_start_timeout: float = 60.0
    placement: Placement = "pack"
    step_timeout: float = 300.0
    name: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool | int = False
    max_restarts: int = 0
    restore_from_replicas: bool = True
    elastic: bool = False
    min_pp: int = 1
    min_dp: int = 1
    replace_wait: float = 10.0
    nonfinite: NonfinitePolicy = "error"
    log_dir: str | None = None
    loggers: list = field(default_factory=lambda: ["tensorboard"])
    devices: str | list[str] = "cpu"
    gpus_per_actor: float = 1.0
    allow_cpu_fallback: bool = False
    lora: dict | None = None
    quantize: str | list | None = None

    def __post_init__(self) -> None:
        validate(self)  # raises ConfigError naming the field, the value and the fix

    def __getattr__(self, name: str) -> SectionView:
        """A section of the fields, read-only (`config.parallel.pp`; `SECTIONS` lists them)."""
        if name in SECTIONS:
            return SectionView(self, name)
        raise AttributeError(f"TrainConfig has no field or section {name!r}")

    def num_chunks(self) -> int:
        """Model chunks per actor: the schedule's own, or `chunks` where it lets the config choose
        (1 for "auto" until the trainer has chosen)."""
        return 1 if self.schedule == "auto" else SCHEDULES[self.schedule].chunks_for(self.chunks)

    def stage_kinds(self) -> list[str]:
        """The accelerator kind of each stage (`devices` given once for all, or per stage)."""
        return [self.devices] * self.pp if isinstance(self.devices, str) else list(self.devices)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
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
        flat: dict[str, Any] = {}
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

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (`checks.plain`: a function as its import path), for records and
        display: a URI's secret shows as `***` (`storage.redact`), never leaked into a record or a print."""
        return redact_values(plain({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed, validated like a new config."""
        unknown = [k for k in changes if k not in self.field_names()]
        if unknown:
            raise ConfigError(f"unknown field {unknown[0]!r}.{nearest(unknown[0], self.field_names())}")
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        """The fields as YAML in their sections, which `from_yaml` reads back."""
        flat = self.to_dict()
        grouped = {section: {name: flat[name] for name in names} for section, names in SECTIONS.items()}
        return yaml.safe_dump(grouped, sort_keys=False).rstrip()


def load_yaml(path: str | Path) -> dict[str, Any]:
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


def parse_yaml(text: str) -> Any:
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


def check_reconfigurable(changes: dict[str, Any], current: TrainConfig | None = None) -> None:
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
