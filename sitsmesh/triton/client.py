"""The ModelServer contract over one Triton server: tritonclient's gRPC asyncio client.

Loads go over gRPC, never HTTP: a load blocks until it finishes, and an HTTP
load can stall inference on the same server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from google.protobuf.json_format import MessageToDict
from tritonclient.grpc import InferInput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from sitsmesh.batching.recommend import batching_of
from sitsmesh.swap.contract import Answer, ServerError, Tensor, VersionState
from sitsmesh.triton import metrics

CALL_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 2.0
# Triton's own messages say "UNAVAILABLE state" of a version; only gRPC's status code and
# transport texts mean the server itself is gone.
_UNREACHABLE = ("failed to connect", "Socket closed", "Connection reset")
MESSAGE_CHARS = 300


def _error(exc: InferenceServerException, label: str, what: str) -> ServerError:
    status = str(exc.status() or "")
    # Triton appends the model's Python traceback; the first line says what happened.
    text = (exc.message() or str(exc)).strip().splitlines()[0][:MESSAGE_CHARS]
    unreachable = status.endswith("UNAVAILABLE") or any(s in text for s in _UNREACHABLE)
    if unreachable:
        return ServerError(f"{label} unreachable during {what}: {text}", unreachable=True)
    if "DEADLINE_EXCEEDED" in status:
        return ServerError(f"{label}: {what} timed out")
    return ServerError(f"{label}: {what} failed: {text}")


class TritonServer:
    def __init__(self, name: str, url: str, metrics_url: str = "") -> None:
        self.label = f"{name} ({url})"
        self._client = InferenceServerClient(url)
        self._metrics_url = metrics_url

    async def index(self) -> list[VersionState]:
        try:
            reply = await self._client.get_model_repository_index(client_timeout=CALL_TIMEOUT_S)
        except InferenceServerException as exc:
            raise _error(exc, self.label, "repository index") from None
        return [VersionState(m.name, int(m.version) if m.version else 0, m.state, m.reason)
                for m in reply.models]

    async def ready_versions(self, model: str) -> list[int]:
        return sorted(v.version for v in await self.index()
                      if v.model == model and v.state == "READY" and v.version)

    async def model_config(self, model: str) -> dict[str, Any]:
        try:
            reply = await self._client.get_model_config(model, client_timeout=CALL_TIMEOUT_S)
        except InferenceServerException as exc:
            raise _error(exc, self.label, f"reading the config of {model}") from None
        config: dict[str, Any] = MessageToDict(reply.config, preserving_proto_field_name=True)
        return config

    async def load(self, model: str, config: dict[str, Any], timeout_s: float) -> None:
        try:
            await self._client.load_model(model, config=json.dumps(config),
                                          client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise _error(exc, self.label, f"loading {model}") from None

    async def unload(self, model: str) -> None:
        try:
            await self._client.unload_model(model, client_timeout=CALL_TIMEOUT_S)
        except InferenceServerException as exc:
            raise _error(exc, self.label, f"unloading {model}") from None

    async def infer(self, model: str, version: int | None, inputs: list[Tensor],
                    timeout_s: float) -> Answer:
        request = []
        for tensor in inputs:
            item = InferInput(tensor.name, list(tensor.shape), tensor.datatype)
            dtype = triton_to_np_dtype(tensor.datatype)
            item.set_data_from_numpy(np.array(tensor.values, dtype=dtype).reshape(tensor.shape))
            request.append(item)
        started = time.perf_counter()
        try:
            result = await self._client.infer(
                model, request, model_version="" if version is None else str(version),
                client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise _error(exc, self.label, f"inference on {model}") from None
        seconds = time.perf_counter() - started
        answered = result.get_response().model_version
        return Answer(int(answered) if answered else 0, seconds)

    async def request_counts(self, model: str) -> dict[int, int]:
        try:
            reply = await self._client.get_inference_statistics(
                model, client_timeout=CALL_TIMEOUT_S)
        except InferenceServerException as exc:
            raise _error(exc, self.label, f"statistics of {model}") from None
        return {int(s.version): s.inference_stats.success.count + s.inference_stats.fail.count
                for s in reply.model_stats if s.version}

    async def pending(self, model: str) -> dict[int, int] | None:
        if not self._metrics_url:
            return None
        try:
            text = await asyncio.to_thread(metrics.fetch, self._metrics_url, METRICS_TIMEOUT_S)
        except OSError as exc:
            raise ServerError(f"{self.label}: metrics at {self._metrics_url} unreadable: "
                              f"{exc}", unreachable=True) from None
        return {version: int(values.get("pending", 0))
                for (name, version), values in metrics.by_version(text).items()
                if name == model and "pending" in values}

    async def close(self) -> None:
        await self._client.close()


def instance_count(config: dict[str, Any]) -> int:
    """How many requests a model executes at once: its instance groups' counts (one per
    listed GPU for a GPU group). A config without groups gets Triton's default, one."""
    total = 0
    for group in config.get("instance_group", []) or []:
        count = int(group.get("count", 1) or 1)
        gpus = group.get("gpus") or []
        total += count * len(gpus) if group.get("kind") == "KIND_GPU" and gpus else count
    return total or 1


def execute_slots(config: dict[str, Any]) -> int:
    """Items a model executes at once: its instances times the batch each takes when a
    queue stands (dynamic batching's largest preferred size, else its max batch)."""
    largest = int(config.get("max_batch_size", 0) or 0)
    return instance_count(config) * batching_of(config).batch_items(largest)
