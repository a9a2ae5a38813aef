"""What accelerator this machine has, and how it advertises it to Ray.

`detect()` finds the local kind (cuda; rocm, which torch also calls cuda but marks
with `torch.version.hip`; mps; else cpu), how many, their model, memory and which
dtypes they train in. `ray_start_args()` turns that into the arguments for
`ray start` (`raypipe node-resources` prints them): a custom resource per kind
(`cuda`, `rocm`, `mps`) with the device count, `--num-gpus` for cuda and rocm so Ray
sets the visible devices, and node labels with the kind and model that stages can
select on. No one writes these by hand.
"""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass

import torch

from raypipe.core import env
from raypipe.core.errors import ConfigError

KINDS = ("cuda", "rocm", "mps", "cpu")
LABEL_KIND = "raypipe.io/accelerator"
LABEL_MODEL = "raypipe.io/accelerator-model"
SERVING_ENV = env.SERVING_ENV  # set in each stage or profiler process to the kind it serves


@dataclass(frozen=True)
class Accelerator:
    """The accelerators of one machine: all of one kind (cpu when there are none)."""

    kind: str
    count: int
    model: str
    memory_bytes: int  # per device; the machine's RAM for cpu, unified memory for mps
    dtypes: tuple[str, ...]  # of "fp32", "bf16", "fp16"

    def torch_device(self, index: int = 0) -> str:
        """The torch device string for device `index` (ROCm devices are `cuda:i` in torch)."""
        if self.kind in ("cuda", "rocm"):
            return f"cuda:{index}"
        return self.kind

    def ray_resources(self) -> dict[str, float]:
        """Custom Ray resources naming the kind, one unit per device (none for cpu: Ray counts CPUs)."""
        return {} if self.kind == "cpu" else {self.kind: float(self.count)}

    def ray_labels(self) -> dict[str, str]:
        return {LABEL_KIND: self.kind, LABEL_MODEL: label_value(self.model)}

    def ray_start_args(self) -> list[str]:
        """Arguments for `ray start` on this machine (add --head or --address yourself)."""
        args = []
        if self.kind in ("cuda", "rocm"):
            args.append(f"--num-gpus={self.count}")
        resources = self.ray_resources()
        if resources:
            args.append(f"--resources={json.dumps(resources, separators=(',', ':'))}")
        args.append("--labels=" + ",".join(f"{k}={v}" for k, v in self.ray_labels().items()))
        return args


def detect() -> Accelerator:
    """The local accelerator kind, count, model, memory and supported training dtypes.

    RAYPIPE_FAKE_ACCELERATOR (`raypipe.core.env.fake_accelerator`) replaces the hardware's
    answer, for tests and demos of cuda, rocm and mps nodes on a CPU-only machine.
    """
    fake = env.fake_accelerator()
    if fake is not None:
        return parse_fake_accelerator(fake)
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        props = torch.cuda.get_device_properties(0)
        dtypes = ("fp32", "fp16") + (("bf16",) if torch.cuda.is_bf16_supported() else ())
        return Accelerator(kind, torch.cuda.device_count(), props.name, int(props.total_memory), dtypes)
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        dtypes = ("fp32", "fp16") + (("bf16",) if _works_on("mps", torch.bfloat16) else ())
        return Accelerator("mps", 1, platform.processor() or "Apple silicon", _machine_memory(), dtypes)
    return Accelerator("cpu", os.cpu_count() or 1, _cpu_model(), _machine_memory(), ("fp32", "bf16", "fp16"))


def usable_cores() -> int:
    """The cores this process may run on, as the OS says: its CPU affinity, bounded by a cgroup's
    CPU quota (a container's `--cpus`). Ray's logical CPUs can say more (`ray start --num-cpus`
    raised to fit more actors); threads past these cores only take turns on them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def parse_fake_accelerator(text: str) -> Accelerator:
    """`KIND:COUNT:MODEL` (e.g. `cuda:2:NVIDIA-H100`) as the Accelerator `detect()` reports for it.

    Raises:
        ConfigError: the text is not of that form, names an unknown kind or a count below 1.
    """
    parts = text.split(":", 2)
    fix = "set it as KIND:COUNT:MODEL, e.g. RAYPIPE_FAKE_ACCELERATOR=cuda:2:NVIDIA-H100, or unset it"
    if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or int(parts[1]) < 1 or not parts[2]:
        raise ConfigError(
            f"RAYPIPE_FAKE_ACCELERATOR={text!r} is not KIND:COUNT:MODEL with KIND one of "
            f"{', '.join(KINDS)} and COUNT >= 1: {fix}."
        )
    kind, count, model = parts[0], int(parts[1]), parts[2]
    dtypes = {"mps": ("fp32", "fp16")}.get(kind, ("fp32", "fp16", "bf16"))
    return Accelerator(kind, count, model, _machine_memory(), dtypes)


def ray_options(kind: str, share: float = 1.0) -> dict[str, object]:
    """Ray actor options placing work on a node of accelerator `kind` (none for cpu).

    The custom resource counts devices (`share` of one each), the label selector
    picks nodes that advertise the kind, and `num_gpus` makes Ray set the visible
    cuda/rocm devices.
    """
    if kind == "cpu":
        return {}
    options: dict[str, object] = {"resources": {kind: share}, "label_selector": {LABEL_KIND: kind}}
    if kind in ("cuda", "rocm"):
        options["num_gpus"] = share
    return options


def serving_kind() -> str | None:
    """The accelerator kind this process's stage (or profiler) was placed for; None outside one."""
    return os.environ.get(SERVING_ENV)


def label_value(text: str) -> str:
    """`text` as a valid Ray label value: [A-Za-z0-9_.-], at most 63, alphanumeric at both ends."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "unknown"


def _works_on(device: str, dtype: torch.dtype) -> bool:
    try:
        (torch.ones(2, device=device, dtype=dtype) * 2).sum().item()
        return True
    except Exception:  # the backend lacks the dtype
        return False


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # macOS lacks SC_PHYS_PAGES on some versions
        import subprocess

        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True)
        return int(out.stdout.strip() or 0)
