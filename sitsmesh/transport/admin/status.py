"""GetStatus: what this process serves, where, and since when."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpc import aio

from sitsmesh import __version__
from sitsmesh.admin.enums import label
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.state import StateStore
from sitsmesh.status import Serving, StatusBoard
from sitsmesh.transport.admin.common import timestamp

_STATES = {
    Serving.SERVING: admin_pb2.SERVING_STATE_SERVING,
    Serving.NOT_SERVING: admin_pb2.SERVING_STATE_NOT_SERVING,
    Serving.DRAINING: admin_pb2.SERVING_STATE_DRAINING,
}


class StatusAdmin:
    RPCS = ("GetStatus",)

    def __init__(self, board: StatusBoard, store: StateStore, *, config_version: str,
                 bound: Mapping[str, str]) -> None:
        """`bound` maps data/admin/metrics to the addresses actually bound; it fills in
        as the listeners start, before the first call can arrive."""
        self._board = board
        self._store = store
        self._config_version = config_version
        self._bound = bound

    async def GetStatus(self, request: admin_pb2.GetStatusRequest,
                        context: aio.ServicerContext[Any, Any]) -> admin_pb2.GetStatusResponse:
        return admin_pb2.GetStatusResponse(
            version=__version__,
            uptime_seconds=self._board.uptime(),
            started_at=timestamp(self._board.started_at),
            services=[
                admin_pb2.ServiceStatus(name=s.name, server=label(admin_pb2.Listener, s.server),
                                        state=_STATES[s.state])
                for s in self._board.services()
            ],
            config_version=self._config_version,
            state_revision=await self._store.revision(),
            data_addr=self._bound["data"],
            admin_addr=self._bound["admin"],
            metrics_addr=self._bound["metrics"],
            workers=[
                admin_pb2.WorkerStatus(index=w.index, pid=w.pid, alive=w.alive,
                                       restarts=w.restarts)
                for w in self._board.workers()
            ],
        )
