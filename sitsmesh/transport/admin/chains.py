"""Pipelines and latency chains on the admin API, and stage reports from services."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from grpc import aio

from sitsmesh import logs, workerguard
from sitsmesh.access import Credential, content
from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.chains.assembler import Assembler, Hop
from sitsmesh.chains.catalog import PipelineCatalog
from sitsmesh.chains.pipeline import Pipeline, pipeline_from
from sitsmesh.chains.tokenjoin import TokenJoin
from sitsmesh.chains.trace import trace_id
from sitsmesh.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from sitsmesh.tokens.timing import End, StreamSummary
from sitsmesh.tokens.window import TokenWindows
from sitsmesh.transport.admin import tokenreply
from sitsmesh.transport.admin.common import read_yaml, yaml_text
from sitsmesh.transport.admin.paging import (
    PageTokens,
    check_mask,
    page,
    page_size,
    scope_of,
    trimmed,
)
from sitsmesh.transport.adminaccess import NOT_PARSED, credential, parsed
from sitsmesh.transport.auth import PermissionDeniedError

_log = logs.get("sitsmesh.admin")
WINDOWS = {"1m": 60, "5m": 300}


class ChainAdmin:
    RPCS = ("ApplyPipeline", "GetPipeline", "ListPipelines", "DeletePipeline",
            "GetLatencyChain", "ReportStageLatency")

    def __init__(self, catalog: PipelineCatalog, assembler: Assembler | None,
                 tokens: PageTokens, *, workers: int = 1,
                 report: Callable[[Hop], None] | None = None,
                 streams: TokenWindows | None = None,
                 reported: Callable[[str, str, StreamSummary, str], bool] | None = None,
                 joined: TokenJoin | None = None) -> None:
        """`assembler` is None where this process does not serve the data plane; stage
        reports go to `report` (the shared hop bus) when given, else to it. `streams`:
        the token streams each stage finished, joined to its row; `reported` takes a
        stage report's token figures (False: no such pipeline stage); `joined`: the token
        streams joined to their requests' chains, where this process joins them."""
        self._streams = streams
        self._joined = joined
        self._reported = reported
        self._catalog = catalog
        self._tokens = tokens
        self._assembler = assembler
        self._workers = workers
        self._report = report or (assembler.add if assembler is not None else None)

    async def ApplyPipeline(self, request: admin_pb2.ApplyPipelineRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.ApplyPipelineResponse:
        source = request.source or "pipeline"
        doc = parsed(request.yaml)
        if doc is NOT_PARSED:
            doc = await read_yaml(request.yaml, source)
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            raise InvalidArgumentError(f"{source}: a pipeline needs a name and stages")
        if self._workers > 1:
            raise workerguard.refuse_pipeline(doc["name"])
        who = credential()
        if who is not None and who.role != "admin":
            if doc.get("tenants") is None:
                doc["tenants"] = content.governed_default(who)
            # Validating and judging a document of up to 1 MiB: off the event loop too.
            reason = await asyncio.to_thread(
                _judge, who, doc, source, self._catalog.pipelines.get(doc["name"]))
            if reason is not None:
                raise PermissionDeniedError(f"ApplyPipeline: {reason}")
        pipeline = await self._catalog.apply(doc["name"], doc, source)
        _log.info("pipeline applied", pipeline=pipeline.name)
        return admin_pb2.ApplyPipelineResponse(pipeline=_pipeline_pb(pipeline))

    async def GetPipeline(self, request: admin_pb2.GetPipelineRequest,
                          context: aio.ServicerContext[Any, Any]
                          ) -> admin_pb2.GetPipelineResponse:
        mask = check_mask(request.read_mask, admin_pb2.Pipeline)
        return admin_pb2.GetPipelineResponse(
            pipeline=trimmed(_pipeline_pb(await self._catalog.get(request.name)), mask))

    async def ListPipelines(self, request: admin_pb2.ListPipelinesRequest,
                            context: aio.ServicerContext[Any, Any]
                            ) -> admin_pb2.ListPipelinesResponse:
        size = page_size(request.page_size)
        mask = check_mask(request.read_mask, admin_pb2.Pipeline)
        await self._catalog.refresh()
        pipelines, token = await page(self._tokens, scope_of("ListPipelines"),
                                      list(self._catalog.pipelines.values()),
                                      lambda p: p.name, size=size, token=request.page_token)
        return admin_pb2.ListPipelinesResponse(
            pipelines=[trimmed(_pipeline_pb(p), mask) for p in pipelines],
            next_page_token=token)

    async def DeletePipeline(self, request: admin_pb2.DeletePipelineRequest,
                             context: aio.ServicerContext[Any, Any]
                             ) -> admin_pb2.DeletePipelineResponse:
        await self._catalog.delete(request.name)
        _log.info("pipeline deleted", pipeline=request.name)
        return admin_pb2.DeletePipelineResponse()

    async def GetLatencyChain(self, request: admin_pb2.GetLatencyChainRequest,
                              context: aio.ServicerContext[Any, Any]
                              ) -> admin_pb2.GetLatencyChainResponse:
        window = request.window or "1m"
        if window not in WINDOWS:
            raise InvalidArgumentError(
                f"window must be one of {', '.join(WINDOWS)}, got {window!r}")
        if self._assembler is None:
            raise FailedPreconditionError(
                "latency chains are assembled with --workers 1: the entries of one request "
                "could reach different worker processes")
        report = self._assembler.report(request.pipeline, WINDOWS[window])
        if report is None:
            raise NotFoundError(f"pipeline {request.pipeline} does not exist")
        token_stages = (self._streams.report(request.pipeline, WINDOWS[window])
                        if self._streams is not None else {})
        joined = (self._joined.report_for(request.pipeline, WINDOWS[window])
                  if self._joined is not None else None)
        reply = admin_pb2.LatencyChain(
            pipeline=report.pipeline, window=window, chains=report.chains,
            incomplete=report.incomplete, failed=report.failed, e2e_p50_ms=report.e2e_p50_ms,
            e2e_p99_ms=report.e2e_p99_ms, bottleneck=report.bottleneck)
        for stage in report.stages:
            entry = reply.stages.add(name=stage.name, p50_ms=stage.p50_ms, p90_ms=stage.p90_ms,
                                     p99_ms=stage.p99_ms, attributed_ms=stage.attributed_ms,
                                     share_of_e2e_p99=stage.share_of_e2e_p99)
            if stage.ttfb_p99_ms is not None:
                entry.ttfb_p99_ms = stage.ttfb_p99_ms
            if stage.total_p99_ms is not None:
                entry.total_p99_ms = stage.total_p99_ms
            if stage.queue_p99_ms is not None:
                entry.queue_p99_ms = stage.queue_p99_ms
            streamed = token_stages.get(stage.name)
            if streamed is not None:
                tokenreply.stage(entry, streamed)
        for chain in report.slowest:
            slow = reply.slowest.add(
                request_id=chain.request_id, trace_id=chain.trace_id, e2e_ms=chain.e2e_ms,
                failed=chain.failed, stages=[
                    admin_pb2.SlowChainStage(name=s.name, offset_ms=s.offset_ms,
                                             own_ms=s.own_ms, total_ms=s.total_ms)
                    for s in chain.stages])
            if joined is not None:
                tokenreply.slow_chain(slow, joined.requests.get(chain.request_id))
        if joined is not None:
            tokenreply.chain(reply, joined)
        for hist in report.histograms:
            reply.histograms.add(name=hist.name, buckets=[
                admin_pb2.HistogramBucket(le_ms=le, count=n) for le, n in hist.buckets])
        return admin_pb2.GetLatencyChainResponse(chain=reply)

    async def ReportStageLatency(self, request_iterator: AsyncIterator[
                                     admin_pb2.ReportStageLatencyRequest],
                                 context: aio.ServicerContext[Any, Any]
                                 ) -> admin_pb2.ReportStageLatencyResponse:
        accepted = rejected = 0
        async for report in request_iterator:
            start = report.start.ToNanoseconds() / 1e9
            end = report.end.ToNanoseconds() / 1e9
            if (self._report is None or not report.request_id or not report.stage
                    or not report.HasField("start") or end < start):
                rejected += 1
                continue
            ttfb = (report.first_byte.ToNanoseconds() / 1e9 - start
                    if report.HasField("first_byte") else None)
            summary = _streamed(report, start, end)
            if summary is _BAD:
                rejected += 1
                continue
            traceparent = report.traceparent
            # The stream before the hop: a hop may close its chain, which the stream joins.
            if summary is not None and self._reported is not None:
                self._reported(report.pipeline, report.stage, summary, report.request_id)
            self._report(Hop(report.request_id, start, end - start, ttfb=ttfb,
                             pipeline=report.pipeline, stage=report.stage,
                             trace_id=trace_id(traceparent) if traceparent else ""))
            accepted += 1
        return admin_pb2.ReportStageLatencyResponse(accepted=accepted, rejected=rejected)


_BAD = StreamSummary(None, None, None, 0, 0.0, (), 0, End.ERROR)
MAX_TOKENS = 10_000_000  # output tokens one stage report may claim


def _streamed(report: admin_pb2.ReportStageLatencyRequest, start: float,
              end: float) -> StreamSummary | None:
    """A stage report's token figures; None if it has none, _BAD if they cannot be (a
    first token outside the stage's span, a time per token longer than it, more stalls
    than gaps)."""
    if not report.HasField("first_token") and not report.output_tokens:
        return None
    first = report.first_token.ToNanoseconds() / 1e9 if report.HasField("first_token") \
        else None
    tokens, stalls = report.output_tokens, report.stalls
    tpot = (report.time_per_output_token_ms / 1000
            if report.HasField("time_per_output_token_ms") else None)
    if ((first is not None and not start <= first <= end) or tokens > MAX_TOKENS
            or (tpot is not None and not 0.0 <= tpot <= end - start)
            or stalls > max(0, tokens - 1)):
        return _BAD
    span = end - first if first is not None else 0.0
    return StreamSummary(first - start if first is not None else None, tpot, tpot, tokens,
                         (tokens - 1) / span if span > 0 and tokens > 1 else 0.0, (),
                         stalls, End.COMPLETE)


def _judge(who: Credential, doc: dict[str, Any], source: str,
           before: Pipeline | None) -> str | None:
    return content.pipeline(who, pipeline_from(doc["name"], doc, source), before)


def _pipeline_pb(pipeline: Pipeline) -> admin_pb2.Pipeline:
    return admin_pb2.Pipeline(name=pipeline.name,
                              yaml=yaml_text({"name": pipeline.name, **pipeline.to_body()}))
