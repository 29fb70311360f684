"""Token streams (Envoy's ext_proc filter): TTFT, inter-token latency and stalls of the
streaming responses Envoy shows sitsmesh, where the data plane runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from sitsmesh import logs
from sitsmesh.app.background import DataService
from sitsmesh.app.components import ChainsComponent
from sitsmesh.chains.tokenjoin import TokenJoin
from sitsmesh.tokens import envoytimed
from sitsmesh.tokens.metrics import TokenMetrics
from sitsmesh.tokens.stages import UNKNOWN, StageIndex
from sitsmesh.tokens.stalls import DEFAULT_S, StallThresholds
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import StreamSummary
from sitsmesh.tokens.window import TokenWindows
from sitsmesh.transport.extproc import SERVICE_NAME, ExternalProcessorServicer, add_to_server
from sitsmesh.transport.extprocmux import ExtProcMux
from sitsmesh.transport.streamcheck import StreamCheckServicer
from sitsmesh.transport.streams import OpenStreams

_log = logs.get("sitsmesh.tokens")
# A gap between two tokens longer than this is a stall, for a stream of no stage and
# for a stage until its own threshold is learned (tokens/stalls.py).
STALL_S = DEFAULT_S


class TokensComponent:
    def __init__(self, registry: CollectorRegistry | None, *, serve: bool) -> None:
        self._metrics = TokenMetrics(registry) if serve else None
        self._stages = StageIndex()
        self._stalls = StallThresholds(self._stages)
        # Per stage over the chain report's windows (GetLatencyChain, `chain show`).
        self.windows = TokenWindows() if serve else None
        # Each stream joined to its request's latency chain (set by attach).
        self.joined: TokenJoin | None = None
        # Each finished stream settles its token-budget reservation (app/tokenbudgets.py).
        self.settle: Callable[[TokenReport], None] | None = None

    def attach(self, chains: ChainsComponent) -> None:
        """Streams are labelled by the pipeline stage their Envoy cluster or route is, and
        join their request's chain where this process assembles chains."""
        chains.pipelines.on_change(self._stages.set_pipelines)
        if self._metrics is not None and chains.assembler is not None:
            self.joined = TokenJoin(on_drop=self._metrics.unjoined)
            self.joined.listen(self._metrics.chain)
            chains.assembler.on_close = self.joined.closed

    def _report(self, report: TokenReport) -> None:
        if self.settle is not None:
            self.settle(report)
        if report.format == envoytimed.JSON:
            return  # a completion that did not stream: its usage settles, nothing more
        pipeline, stage = self._stages.stage_of(report.cluster, report.route)
        self._record(report, pipeline, stage)
        summary = report.summary
        _log.debug("token stream", request_id=report.request_id, path=report.path,
                   pipeline=pipeline, stage=stage,
                   format=report.format, ttft_s=summary.ttft_s, itl_p50_s=summary.itl_p50_s,
                   itl_p99_s=summary.itl_p99_s, tokens=summary.tokens,
                   stalls=summary.stall_count, end=summary.end.value)

    @property
    def timed_in_envoy(self) -> Callable[[Any, Any], None] | None:
        """Where access-log entries of streams Envoy's token-timing filter timed go
        (filters/fragments/token_timing.yaml); None where nothing is recorded."""
        return self._timed_in_envoy if self._metrics is not None else None

    def _timed_in_envoy(self, entry: Any, fields: Any) -> None:
        assert self._metrics is not None
        try:
            report = envoytimed.report(entry, fields, self._stalls.stall_of)
        except (envoytimed.Unreadable, ValueError) as exc:
            self._metrics.untracked("unreadable")
            _log.debug("token timing unreadable", request_id=entry.request.request_id,
                       error=str(exc))
            return
        self._report(report)

    def reported(self, pipeline: str, stage: str, summary: StreamSummary,
                 request_id: str = "") -> bool:
        """A stage behind no Envoy reported its stream (ReportStageLatency): counted as
        format "reported", if the pipeline has that stage."""
        if self._metrics is None or not self._stages.has(pipeline, stage):
            return False
        self._record(TokenReport(request_id, "", "reported", summary, None, 0), pipeline,
                     stage)
        return True

    def _record(self, report: TokenReport, pipeline: str, stage: str) -> None:
        """Into the metrics, and into the chain report's windows if it has a stage."""
        assert self._metrics is not None and self.windows is not None
        self._metrics.observe(report, (pipeline, stage))
        if (pipeline, stage) != UNKNOWN:
            self.windows.add(pipeline, stage, report.summary)
            self._stalls.learn(pipeline, stage, report.summary)
            if self.joined is not None:
                self.joined.report(report.request_id, pipeline, stage, report.summary)

    def services(self, streams: OpenStreams, checks: StreamCheckServicer | None = None
                 ) -> list[DataService]:
        """The data port's ExternalProcessor: this observer, and `checks` (per-message
        checks of gRPC streams) for the ext_proc filter that asks for them."""
        if self._metrics is None:
            return []
        servicer = ExtProcMux(ExternalProcessorServicer(
            self._report, streams, stall_s=STALL_S, stall_of=self._stalls.stall_of,
            untracked=self._metrics.untracked), checks)
        return [DataService(SERVICE_NAME, lambda server: add_to_server(servicer, server))]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
