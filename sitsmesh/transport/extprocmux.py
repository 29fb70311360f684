"""The data port's one ExternalProcessor, for Envoy's two ext_proc filters: the token
observer (filters/fragments/ext_proc.yaml) and the per-message checks of gRPC streams
(grpc_stream_check.yaml). The check filter says which it is in its gRPC initial
metadata (ROLE_HEADER); both come from the same callers (data_callers `tokens`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc import aio

from sitsmesh.errors import FailedPreconditionError
from sitsmesh.transport.errors import abort
from sitsmesh.transport.extproc import ExternalProcessorServicer
from sitsmesh.transport.streamcheck import StreamCheckServicer

ROLE_HEADER, CHECK_ROLE = "x-sitsmesh-ext-proc", "check"


class ExtProcMux(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, observe: ExternalProcessorServicer,
                 check: StreamCheckServicer | None) -> None:
        self._observe = observe
        self._check = check

    async def Process(self, request_iterator: AsyncIterator[Any],
                      context: aio.ServicerContext[Any, Any]) -> None:
        role = next((value for key, value in context.invocation_metadata() or ()
                     if key == ROLE_HEADER), "")
        if role != CHECK_ROLE:
            await self._observe.Process(request_iterator, context)
        elif self._check is None:
            await abort(context, FailedPreconditionError(
                "per-message stream checks are not served by this process"))
        else:
            await self._check.Process(request_iterator, context)
