"""What the process is serving right now: the source for health and GetStatus."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class Serving(enum.Enum):
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    DRAINING = "DRAINING"


@dataclass(slots=True)
class ServiceState:
    name: str
    server: str
    state: Serving


@dataclass(frozen=True, slots=True)
class WorkerState:
    index: int
    pid: int
    alive: bool
    restarts: int


class StatusBoard:
    """Per-service serving state. Listeners are told of every change (the health servicer)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.started_at = clock()
        self._started_mono = monotonic()
        self._monotonic = monotonic
        self._services: dict[str, ServiceState] = {}
        self._listeners: list[Callable[[ServiceState], None]] = []
        self.workers: Callable[[], list[WorkerState]] = list

    def uptime(self) -> float:
        return self._monotonic() - self._started_mono

    def add_listener(self, listener: Callable[[ServiceState], None]) -> None:
        self._listeners.append(listener)
        for service in self._services.values():
            listener(service)

    def register(self, name: str, server: str, state: Serving = Serving.NOT_SERVING) -> None:
        self._services[name] = ServiceState(name, server, state)
        self._notify(self._services[name])

    def set(self, name: str, state: Serving) -> None:
        service = self._services[name]
        if service.state is not state:
            service.state = state
            self._notify(service)

    def state(self, name: str) -> Serving | None:
        """The service's state, or None when no server registered it (yet)."""
        service = self._services.get(name)
        return None if service is None else service.state

    def set_all(self, state: Serving, server: str | None = None) -> None:
        for service in self._services.values():
            if server is None or service.server == server:
                service.state = state
                self._notify(service)

    def services(self) -> list[ServiceState]:
        return sorted(self._services.values(), key=lambda s: (s.server, s.name))

    def _notify(self, service: ServiceState) -> None:
        for listener in self._listeners:
            listener(service)
