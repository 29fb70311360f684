"""The telemetry component: decision metrics and the decision log, flushed off the
request path once a second and at stop."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from sitsmesh.app.background import HOUSEKEEPING_S, Background
from sitsmesh.config import Settings
from sitsmesh.telemetry.decisionlog import DecisionLog
from sitsmesh.telemetry.decisions import AuthzMetrics, Telemetry


class TelemetryComponent:
    def __init__(self, settings: Settings, registry: CollectorRegistry | None, *,
                 serve: bool, pipeline_of: Callable[[str, str], str]) -> None:
        log = None
        if serve and settings.decision_log != "off":
            log = DecisionLog(
                settings.decision_log, sample=settings.decision_log_sample,
                max_per_s=settings.decision_log_max_per_s,
                headers=settings.decision_log_headers,
                # What identifies a caller is masked wherever the settings move it.
                mask=(*settings.decision_log_mask, *settings.authz_api_key_headers,
                      *((settings.authz_jwt_header,) if settings.authz_jwt_header else ())),
                pipeline_of=pipeline_of)
        # Only where the data plane runs: a supervisor decides nothing.
        self.telemetry = (Telemetry(AuthzMetrics(registry, settings.metrics_max_tenants), log)
                          if serve else None)
        self._background = Background()

    async def start(self) -> None:
        if self.telemetry is not None:
            self._background.every(HOUSEKEEPING_S, self.telemetry.flush)

    async def stop(self) -> None:
        await self._background.stop()
        if self.telemetry is not None:
            self.telemetry.flush()
