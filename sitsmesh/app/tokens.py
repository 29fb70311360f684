"""Token streams (Envoy's ext_proc filter): TTFT, inter-token latency and stalls of the
streaming responses Envoy shows sitsmesh, where the data plane runs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sitsmesh import logs
from sitsmesh.app.background import DataService
from sitsmesh.app.components import ChainsComponent
from sitsmesh.tokens.metrics import TokenMetrics
from sitsmesh.tokens.stages import UNKNOWN, StageIndex
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import StreamSummary
from sitsmesh.tokens.window import TokenWindows
from sitsmesh.transport.extproc import SERVICE_NAME, ExternalProcessorServicer, add_to_server
from sitsmesh.transport.streams import OpenStreams

_log = logs.get("sitsmesh.tokens")
# A gap between two tokens longer than this is a stall (per stage, later: learned).
STALL_S = 1.0


class TokensComponent:
    def __init__(self, registry: CollectorRegistry | None, *, serve: bool) -> None:
        self._metrics = TokenMetrics(registry) if serve else None
        self._stages = StageIndex()
        # Per stage over the chain report's windows (GetLatencyChain, `chain show`).
        self.windows = TokenWindows() if serve else None

    def attach(self, chains: ChainsComponent) -> None:
        """Streams are labelled by the pipeline stage their Envoy cluster or route is."""
        chains.pipelines.on_change(self._stages.set_pipelines)

    def _report(self, report: TokenReport) -> None:
        pipeline, stage = self._stages.stage_of(report.cluster, report.route)
        self._record(report, pipeline, stage)
        summary = report.summary
        _log.debug("token stream", request_id=report.request_id, path=report.path,
                   pipeline=pipeline, stage=stage,
                   format=report.format, ttft_s=summary.ttft_s, itl_p50_s=summary.itl_p50_s,
                   itl_p99_s=summary.itl_p99_s, tokens=summary.tokens,
                   stalls=summary.stall_count, end=summary.end.value)

    def reported(self, pipeline: str, stage: str, summary: StreamSummary) -> bool:
        """A stage behind no Envoy reported its stream (ReportStageLatency): counted as
        format "reported", if the pipeline has that stage."""
        if self._metrics is None or not self._stages.has(pipeline, stage):
            return False
        self._record(TokenReport("", "", "reported", summary, None, 0), pipeline, stage)
        return True

    def _record(self, report: TokenReport, pipeline: str, stage: str) -> None:
        """Into the metrics, and into the chain report's windows if it has a stage."""
        assert self._metrics is not None and self.windows is not None
        self._metrics.observe(report, (pipeline, stage))
        if (pipeline, stage) != UNKNOWN:
            self.windows.add(pipeline, stage, report.summary)

    def services(self, streams: OpenStreams) -> list[DataService]:
        if self._metrics is None:
            return []
        servicer = ExternalProcessorServicer(self._report, streams, stall_s=STALL_S,
                                             untracked=self._metrics.untracked)
        return [DataService(SERVICE_NAME, lambda server: add_to_server(servicer, server))]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
