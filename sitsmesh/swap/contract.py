"""What the swap protocol needs from a model server, apart from any implementation.

The Triton adapter (sitsmesh.triton.client) implements it over gRPC; unit
tests of the protocol use a double.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class VersionState:
    model: str
    version: int
    state: str        # READY, UNAVAILABLE, LOADING, UNLOADING
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One probe input: a name, a Triton datatype (FP32, INT64, BYTES...), a shape, values."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: tuple[Any, ...]   # flattened, row-major


@dataclass(frozen=True, slots=True)
class Answer:
    version: int      # the version that answered, from the response
    seconds: float


class ServerError(Exception):
    """A call to the model server failed. `unreachable` when the server itself is gone."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.unreachable = unreachable


class ModelServer(Protocol):
    """One Triton server, as the swap protocol drives it. Errors raise ServerError."""

    label: str  # for messages: the endpoint name and address

    async def index(self) -> list[VersionState]:
        """The repository index: every model and the versions the server knows of."""
        ...

    async def model_config(self, model: str) -> dict[str, Any]:
        """The config in force, in protobuf JSON form (the shape a load override takes)."""
        ...

    async def load(self, model: str, config: dict[str, Any], timeout_s: float) -> None:
        """Load (or change) the model with this config override; returns when done."""
        ...

    async def unload(self, model: str) -> None: ...

    async def ready_versions(self, model: str) -> list[int]: ...

    async def infer(self, model: str, version: int | None, inputs: list[Tensor],
                    timeout_s: float) -> Answer: ...

    async def request_counts(self, model: str) -> dict[int, int]:
        """Requests each loaded version has finished (success + failure), from statistics."""
        ...

    async def pending(self, model: str) -> dict[int, int] | None:
        """Requests queued or running per version (metrics port); None when not known."""
        ...

    async def close(self) -> None: ...
