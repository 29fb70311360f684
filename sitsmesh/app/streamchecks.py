"""Per-message checks of gRPC streams where the data plane runs: the checker, fed by the
tenant directory, so a revoked key or tenant cuts its open streams at once."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sitsmesh.app.background import Background
from sitsmesh.app.components import AuthzComponent
from sitsmesh.authz.streamcheck import StreamCheckSettings
from sitsmesh.config import Settings
from sitsmesh.transport.streamcheck import StreamCheckMetrics, StreamCheckServicer

# Keys expire by the clock, not by a directory change: open streams re-read their
# caller's key this often.
EXPIRY_CHECK_S = 0.25


class StreamChecksComponent:
    def __init__(self, settings: Settings, authz: AuthzComponent,
                 registry: CollectorRegistry | None) -> None:
        self._background = Background()
        self.servicer: StreamCheckServicer | None = None
        if authz.authorizer is None:
            return
        self.servicer = servicer = StreamCheckServicer(
            authz.authorizer, StreamCheckSettings(
                dict(settings.stream_check_methods), settings.max_message_bytes,
                settings.stream_check_deadline_seconds,
                settings.stream_check_fail_mode == "open"),
            StreamCheckMetrics(registry))
        authz.directory.on_change(lambda snapshot, policy: servicer.recheck())

    async def start(self) -> None:
        if self.servicer is not None:
            self._background.every(EXPIRY_CHECK_S, self.servicer.recheck)

    async def stop(self) -> None:
        await self._background.stop()
