"""sitsmesh.admin.v1.Admin servicer: protobuf in, domain state out."""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from sitsmesh import __version__
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.config import Settings
from sitsmesh.state import StateStore
from sitsmesh.status import Serving, StatusBoard

_STATES = {
    Serving.SERVING: admin_pb2.SERVING,
    Serving.NOT_SERVING: admin_pb2.NOT_SERVING,
    Serving.DRAINING: admin_pb2.DRAINING,
}


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, settings: Settings, board: StatusBoard, store: StateStore,
                 bound: dict[str, str]) -> None:
        self._settings = settings
        self._board = board
        self._store = store
        self._bound = bound

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: aio.ServicerContext[Any, Any]
    ) -> admin_pb2.GetStatusResponse:
        started = Timestamp()
        started.FromNanoseconds(int(self._board.started_at * 1e9))
        return admin_pb2.GetStatusResponse(
            version=__version__,
            uptime_seconds=self._board.uptime(),
            started_at=started,
            services=[
                admin_pb2.ServiceStatus(name=s.name, server=s.server, state=_STATES[s.state])
                for s in self._board.services()
            ],
            config_version=self._settings.config_version,
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
