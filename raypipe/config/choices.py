"""The closed choices of `TrainConfig`'s fields: each a `Literal` type the field carries (what an
editor completes and a type checker holds) and the tuple `validation` checks a value against,
made from it so the two cannot differ. The open choices, engines and schedules, are their
registries' names (`config/engines.py`, `schedules/`); a boundary codec is `transport.compress.Codec`."""

from __future__ import annotations

from typing import Literal, get_args

SameNodeTransport = Literal["shm", "gloo"]
DeviceLinks = Literal["auto", "nccl", "host"]  # raypipe.driver.links.ways
Partition = Literal["uniform", "parameters", "profile"]
Precision = Literal["fp32", "bf16", "fp16"]
BoundaryDtype = Literal["auto", "fp32", "bf16", "fp16"]  # "auto": raypipe.driver.links.advice
NonfinitePolicy = Literal["error", "skip"]
Placement = Literal["pack", "spread", "strict_spread"]  # raypipe.driver.cluster.gang.STRATEGIES
SAME_NODE_TRANSPORTS = get_args(SameNodeTransport)
DEVICE_LINKS = get_args(DeviceLinks)
PARTITION_NAMES = get_args(Partition)
PRECISIONS = get_args(Precision)
BOUNDARY_DTYPES = get_args(BoundaryDtype)
NONFINITE_POLICIES = get_args(NonfinitePolicy)
PLACEMENTS = get_args(Placement)
