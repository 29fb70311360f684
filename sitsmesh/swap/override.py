"""The config overrides a swap loads with, and the probe inputs it sends: pure functions.

Triton reloads (and so cools) every version of a model whose config changes
in anything but `version_policy`. So a swap computes one override at the
start, adding `model_warmup` when the model has none, and every later load of
the swap (promote, retire, rollback) sends that same override with only the
version policy changed.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sitsmesh.swap.contract import Tensor

WARMUP_NAME = "sitsmesh_warmup"
# Triton's config enum name -> its inference datatype name.
DATATYPES = {
    "TYPE_BOOL": "BOOL", "TYPE_UINT8": "UINT8", "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32", "TYPE_UINT64": "UINT64", "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16", "TYPE_INT32": "INT32", "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16", "TYPE_FP32": "FP32", "TYPE_FP64": "FP64", "TYPE_STRING": "BYTES",
    "TYPE_BF16": "BF16",
}


class InvalidSwapInput(ValueError):
    """The model config or the swap options cannot produce warmup or probe data."""


@dataclass(frozen=True, slots=True)
class SwapOptions:
    warmup_count: int = 2                 # warmup runs per instance, inside the load
    warmup_data: str = "zero"             # zero or random
    sample: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # probe values
    verify_probes: int = 20
    max_latency_ratio: float = 2.0        # new version p50 and first probe vs old p50
    latency_slack_ms: float = 5.0         # absolute allowance: CPU timing noise at ~ms
    drain_timeout_s: float = 30.0
    load_timeout_s: float = 300.0
    max_pending: int = 64                 # precheck: queued requests that block a swap

    def validate(self) -> None:
        if not 1 <= self.warmup_count <= 1000:
            raise InvalidSwapInput(f"warmup_count must be 1-1000, got {self.warmup_count}")
        if self.warmup_data not in ("zero", "random"):
            raise InvalidSwapInput(
                f"warmup_data must be zero or random, got {self.warmup_data!r}")
        if not 1 <= self.verify_probes <= 10_000:
            raise InvalidSwapInput(f"verify_probes must be 1-10000, got {self.verify_probes}")
        if not self.max_latency_ratio >= 1.0:
            raise InvalidSwapInput(
                f"max_latency_ratio must be at least 1, got {self.max_latency_ratio}")
        for name, value in (("latency_slack_ms", self.latency_slack_ms),
                            ("drain_timeout_s", self.drain_timeout_s),
                            ("load_timeout_s", self.load_timeout_s)):
            if not 0 <= value <= 3600 or math.isnan(value):
                raise InvalidSwapInput(f"{name} must be 0-3600, got {value}")
        if self.max_pending < 0:
            raise InvalidSwapInput(f"max_pending must be >= 0, got {self.max_pending}")


def _dims(raw: Iterable[Any]) -> list[int]:
    # int64 fields come back from protobuf JSON as strings.
    return [int(d) for d in raw]


def _inputs(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    inputs = config.get("input") or []
    if not inputs:
        raise InvalidSwapInput(f"model {config.get('name')!r} declares no inputs: nothing to "
                               "warm up or probe with")
    return list(inputs)


def warmup_samples(config: Mapping[str, Any], options: SwapOptions) -> list[dict[str, Any]]:
    """One `model_warmup` sample built from the model's inputs."""
    sample_inputs: dict[str, Any] = {}
    for spec in _inputs(config):
        data_type = spec.get("data_type", "TYPE_FP32")
        if data_type not in DATATYPES:
            raise InvalidSwapInput(f"input {spec.get('name')!r}: unsupported data type "
                                   f"{data_type!r}")
        # Triton cannot make random strings; zeros (empty strings) are the only choice there.
        kind = ("random_data" if options.warmup_data == "random" and data_type != "TYPE_STRING"
                else "zero_data")
        sample_inputs[spec["name"]] = {
            "data_type": data_type,
            "dims": [d if d > 0 else 1 for d in _dims(spec.get("dims", []))],
            kind: True,
        }
    return [{"name": WARMUP_NAME, "batch_size": 1, "count": options.warmup_count,
             "inputs": sample_inputs}]


def swap_override(current: Mapping[str, Any], options: SwapOptions) -> dict[str, Any]:
    """The config every load of one swap sends (version policy aside)."""
    config = copy.deepcopy(dict(current))
    if not config.get("model_warmup"):
        config["model_warmup"] = warmup_samples(config, options)
    return config


def with_versions(override: Mapping[str, Any], versions: Iterable[int]) -> dict[str, Any]:
    config = copy.deepcopy(dict(override))
    config["version_policy"] = {"specific": {"versions": sorted(set(versions))}}
    return config


def probe_inputs(config: Mapping[str, Any], options: SwapOptions) -> list[Tensor]:
    """One request's inputs: the options' sample values, or zeros of the declared shape."""
    batched = int(config.get("max_batch_size", 0) or 0) > 0
    tensors = []
    for spec in _inputs(config):
        name = spec["name"]
        datatype = DATATYPES.get(spec.get("data_type", "TYPE_FP32"))
        if datatype is None:
            raise InvalidSwapInput(f"input {name!r}: unsupported data type "
                                   f"{spec.get('data_type')!r}")
        shape = tuple(([1] if batched else []) + [d if d > 0 else 1
                                                  for d in _dims(spec.get("dims", []))])
        size = math.prod(shape)
        if name in options.sample:
            values = tuple(options.sample[name])
            if len(values) != size:
                raise InvalidSwapInput(f"sample for {name} has {len(values)} values; the "
                                       f"input takes shape {list(shape)} ({size} values)")
        else:
            zero: Any = b"" if datatype == "BYTES" else (False if datatype == "BOOL" else 0)
            values = (zero,) * size
        tensors.append(Tensor(name, datatype, shape, values))
    unknown = set(options.sample) - {t.name for t in tensors}
    if unknown:
        raise InvalidSwapInput(f"sample names unknown inputs: {', '.join(sorted(unknown))}")
    return tensors
