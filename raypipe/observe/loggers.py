"""Experiment loggers: the same scalars of every step to TensorBoard, MLflow and Weights & Biases.

`TrainConfig.loggers` names them (`["tensorboard", "mlflow", "wandb"]`, each optionally with
its options, `{"mlflow": {"tracking_uri": "sqlite:///runs.db"}}`). The driver records each
step's metrics, as `scalars` flattens them, and anything passed to `Trainer.log` (the job's
validation loss); each logger opens its run at the first record, with the run name and the
configuration, and closes it when the trainer shuts down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from raypipe.config.loggers import entry_of

if TYPE_CHECKING:
    from raypipe.config import TrainConfig


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A step's metrics (`raypipe.observe.metrics.step_metrics`) as flat scalar tags, the same for every logger.

    Tags: train/loss, train/lr, train/grad_norm, train/tokens_per_s (or train/samples_per_s),
    train/step_time, train/pp and train/dp (the topology the step ran on: an elastic run's
    changes), and per stage stage{s}/forward_s, stage{s}/backward_s,
    stage{s}/bubble_fraction, stage{s}/peak_memory_bytes and its split stage{s}/memory_{part}_bytes
    (part: parameters, gradients, optimizer_state, activations, other), stage{s}/peak_stashed_microbatches (kept
    for backward), stage{s}/peak_awaiting_weight_grad (split backwards: between input and weight
    gradient), stage{s}/sent_bytes (activations and gradients sent to the neighbouring stages) and,
    when measured, stage{s}/peak_stashed_bytes. A model with MoE layers adds stage{s}/all_to_all_s
    and stage{s}/all_to_all_bytes, and per MoE layer (keyed by its global layer index)
    moe/layer{l}/expert{e}_tokens and moe/layer{l}/dropped_tokens. Under fp16, train/loss_scale.
    Under an objective, each of its metrics by TRL's name: train/rewards/chosen, train/kl, ...
    """
    rate = "tokens_per_s" if "tokens_per_s" in metrics else "samples_per_s"
    tags = {
        f"train/{key}": float(metrics[key])
        for key in ("loss", "lr", "grad_norm", rate, "step_time", "loss_scale", "pp", "dp")
        if key in metrics
    }
    tags |= {f"train/{key}": float(value) for key, value in metrics.get("objective", {}).items()}
    for s, stage in enumerate(metrics.get("stages", [])):
        for key, tag in (
            ("forward_s", "forward_s"),
            ("backward_s", "backward_s"),
            ("bubble", "bubble_fraction"),
            ("peak_memory_bytes", "peak_memory_bytes"),
            ("peak_stashed_microbatches", None),
            ("peak_awaiting_weight_grad", None),
            ("sent_bytes", None),
            ("peak_stashed_bytes", None),
            ("all_to_all_s", None),
            ("all_to_all_bytes", None),
        ):
            if key in stage:
                tags[f"stage{s}/{tag or key}"] = float(stage[key])
        for part, value in stage.get("memory", {}).items():
            if part != "peak":
                tags[f"stage{s}/memory_{part}_bytes"] = float(value)
        for layer, routed in stage.get("experts", {}).items():
            for e, count in enumerate(routed["routed"]):
                tags[f"moe/layer{layer}/expert{e}_tokens"] = float(count)
            tags[f"moe/layer{layer}/dropped_tokens"] = float(routed["dropped"])
    return tags


def run_params(config: TrainConfig, run_name: str, plan: Any, run_id: str | None = None) -> dict[str, Any]:
    """What a logger records once about the run: the TrainConfig's fields, the run name, its id (a
    resumed run's is the run's it resumes) and the split."""
    from raypipe import __version__

    named = {"run_name": run_name, **({"run_id": run_id} if run_id else {})}
    return {**config.to_dict(), **named, "plan": [list(p) for p in plan], "raypipe_version": __version__}


def flat(params: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Nested parameters as `a.b` keys with string values, for stores that keep flat strings (MLflow)."""
    out: dict[str, str] = {}
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class TensorBoardLogger:
    """Writes the scalars as TensorBoard events in a folder of the run's own under `log_dir`
    (`run_folder`), so `tensorboard --logdir LOG_DIR` draws each run as its own line: a rerun of a
    job is a new run, a resumed run continues its folder (hiding the steps it ran past its
    checkpoint, which it runs again). Without a run id (a logger made by hand) it writes in `log_dir`."""

    @staticmethod
    def wanted(options: dict[str, object], config: TrainConfig) -> dict[str, object] | None:
        """Its options for `config`: its `log_dir` or `config.log_dir`; None (off) when neither is set.
        A logger kind without this method is wanted with the options it was given."""
        options.setdefault("log_dir", config.log_dir)
        return options if options["log_dir"] is not None else None

    def __init__(self, run_name: str, params: dict[str, Any], log_dir: str) -> None:
        run_id = params.get("run_id")
        self.folder, self.continued = run_folder(log_dir, run_id) if run_id else (log_dir, False)
        self.writer: Any = None  # made at the first record, which a continued run purges from

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=self.folder, purge_step=step if self.continued else None)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self, status: str = "FINISHED") -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def run_folder(log_dir: str, run_id: str) -> tuple[str, bool]:
    """The folder under `log_dir` of the run `run_id`, and whether it exists already (a resumed
    run's): `<start time>_<first 8 of the id>`, so TensorBoard lists the runs in the order they began."""
    import os
    import time

    tail = f"_{run_id[:8]}"
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            if name.endswith(tail) and os.path.isdir(os.path.join(log_dir, name)):
                return os.path.join(log_dir, name), True
    return os.path.join(log_dir, time.strftime("%Y-%m-%d_%H-%M-%S") + tail), False


class MLflowLogger:
    """Logs to an MLflow run: the active run of the process when there is one (so a script's own
    `mlflow.start_run()` holds the training), else a new run named after the trainer in
    `experiment`, ended when the trainer shuts down. `tracking_uri` defaults to MLflow's own
    (`MLFLOW_TRACKING_URI`). Steps are written by MLflow's async logging thread, off the training
    loop's path (`benchmarks/loggers.py`), and waited for when the trainer shuts down."""

    def __init__(
        self, run_name: str, params: dict[str, object], tracking_uri: str | None = None, experiment: str = "raypipe"
    ) -> None:
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        active = mlflow.active_run()
        self.owned = active is None or (tracking_uri is not None and tracking_uri != mlflow.get_tracking_uri())
        if self.owned:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=run_name, tags={"raypipe.run": run_name})
            self.run_id = run.info.run_id
        else:
            self.run_id = active.info.run_id
        self.pending: list[Any] = []
        values = [Param(k, v[:6000]) for k, v in flat(params).items()]
        for i in range(0, len(values), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=values[i : i + 100])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics; written by MLflow's own thread
            self.pending.append(self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=False))

    def close(self, status: str = "FINISHED") -> None:
        pending, self.pending = self.pending, []
        for operation in pending:  # every step is in the store before the run ends
            operation.wait()
        if self.owned:
            self.client.set_terminated(self.run_id, status=status)


class WandbLogger:
    """Logs to a Weights & Biases run named after the trainer, in `project` ("raypipe"); `mode`
    "offline" writes it under `dir` for `wandb sync` later. W&B keeps a run's steps increasing, so
    the steps a recovery replays (the same values again) are not sent twice."""

    def __init__(
        self,
        run_name: str,
        params: dict[str, object],
        project: str = "raypipe",
        entity: str | None = None,
        mode: str | None = None,
        dir: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            config=params,
            mode=mode,
            dir=dir,
            tags=tags,
            reinit="create_new",
        )
        self.last = 0

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if step >= self.last:
            self.run.log(dict(values), step=step)
            self.last = step

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class Loggers:
    """The loggers `config.loggers` names, each opened at its first record. TensorBoard writes to
    its `log_dir` option or `config.log_dir`, and is off when neither is set (the default config)."""

    KINDS = {"tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}

    def __init__(self, config: TrainConfig, run_name: str, params: Callable[[], dict[str, Any]]) -> None:
        self.wanted = []
        for entry in config.loggers:
            name, options = entry_of(entry)
            wanted = getattr(self.KINDS[name], "wanted", None)
            options = wanted(options, config) if wanted is not None else options
            if options is not None:
                self.wanted.append((name, options))
        self.run_name, self.params, self.extra, self.open, self.opened = run_name, params, {}, [], False
        self.status = "FINISHED"  # how the run ends for the loggers: FAILED or KILLED when fit did not finish
        self.broken: set[int] = set()  # loggers that raised; reported once, then skipped

    def add_params(self, params: Mapping[str, object]) -> None:
        """Adds to what each logger records once about the run (a job adds its model, data and job
        settings). Before the first record: a logger's run description is written when it opens."""
        if self.opened:
            raise RuntimeError(
                "Loggers.add_params: the loggers have recorded already; add parameters before "
                "the first step or Trainer.log"
            )
        self.extra.update(params)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if not self.opened:
            self.opened, params = True, {**self.params(), **self.extra}
            for name, options in self.wanted:  # one that cannot open (its server down) is reported, not fatal
                try:
                    self.open.append(self.KINDS[name](self.run_name, params, **options))
                except Exception as error:  # noqa: BLE001
                    self._report(name, "open", error)
        for logger in self.open:
            self._guarded(logger, "log", step, values)

    def ended(self, error: BaseException | None) -> None:
        """Records how a `fit` ended, for the loggers' run status at close: FINISHED, or KILLED
        (an interrupt, a SIGTERM) or FAILED (an error); a failed run is never reported finished."""
        if error is None:
            self.status = "FINISHED"
        else:
            self.status = "KILLED" if isinstance(error, (KeyboardInterrupt, SystemExit)) else "FAILED"

    def close(self) -> None:
        """Ends every logger's run with `status`, each waited for at most RAYPIPE_CALL_TIMEOUT s (a
        tracking server that stopped answering must not hang the shutdown)."""
        from raypipe.core.env import call_timeout

        loggers, self.open, self.opened = self.open, [], False
        for logger in loggers:
            self._guarded(logger, "close", self.status, timeout=call_timeout())

    def _guarded(self, logger: object, method: str, *args: object, timeout: float | None = None) -> None:
        """Calls a logger; one that raises (an MLflow server down) is reported once on stderr and
        skipped from then on, so it never stops training or a due checkpoint. With `timeout`, the
        call runs in a thread of its own and is given up after that many seconds."""
        if id(logger) in self.broken:
            return
        if timeout is not None:
            import threading

            outcome: list[BaseException | None] = []

            def call() -> None:
                try:
                    getattr(logger, method)(*args)
                    outcome.append(None)
                except Exception as error:  # noqa: BLE001
                    outcome.append(error)

            worker = threading.Thread(target=call, name=f"raypipe-logger-{method}", daemon=True)
            worker.start()
            worker.join(timeout)
            error = outcome[0] if outcome else TimeoutError(f"no answer within {timeout:.0f} s (RAYPIPE_CALL_TIMEOUT)")
            if error is not None:
                self.broken.add(id(logger))
                self._report(type(logger).__name__, method, error)
            return
        try:
            getattr(logger, method)(*args)
        except Exception as error:  # noqa: BLE001 - any logger failure: training goes on
            self.broken.add(id(logger))
            self._report(type(logger).__name__, method, error)

    @staticmethod
    def _report(name: str, method: str, error: Exception) -> None:
        import sys

        print(
            f"raypipe: logger {name}.{method} failed ({type(error).__name__}: {error}); it records nothing "
            f"more this run, training goes on",
            file=sys.stderr,
        )
