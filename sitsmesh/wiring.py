"""The one place that builds the object graph from settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpc import aio

from sitsmesh.config import Settings


@dataclass(frozen=True, slots=True)
class DataService:
    """An Envoy-facing service on the data-plane server, with its own health status."""

    name: str
    add_to_server: Callable[[aio.Server], None]


def data_services(settings: Settings) -> list[DataService]:
    """Services the data plane carries besides health and reflection.

    Envoy-facing services (ext_authz, ratelimit, access log) are added here as
    they are built; health reports a status for each one by name.
    """
    del settings
    return []
