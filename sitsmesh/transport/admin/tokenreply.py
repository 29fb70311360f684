"""A pipeline's token streams joined to its chains, into GetLatencyChain's reply."""

from __future__ import annotations

from typing import Any

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.chains.tokenjoin import TokenChainReport
from sitsmesh.chains.ttft import RequestTokens, StageStream, owner
from sitsmesh.tokens.window import TokenStageReport


def _copy_known(target: Any, source: Any, names: tuple[str, ...]) -> None:
    """The figures `source` has (not None); an unset proto field reads as unknown."""
    for name in names:
        value = getattr(source, name)
        if value is not None:
            setattr(target, name, value)


def stage(entry: admin_pb2.StageLatencyReport, streamed: TokenStageReport) -> None:
    """A stage's token streams over the report's window."""
    entry.token_streams = streamed.streams
    entry.output_tokens = streamed.tokens
    entry.stalls = streamed.stalls
    _copy_known(entry, streamed, ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"))


def chain(reply: admin_pb2.LatencyChain, joined: TokenChainReport) -> None:
    """Request-level TTFT and ITL, the TTFT owner, and each stage's part of TTFT."""
    reply.token_chains = joined.chains
    reply.token_reports_dropped = joined.dropped
    reply.ttft_owner = joined.ttft_owner
    _copy_known(reply, joined, ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"))
    for stage in reply.stages:
        stage.ttft_attributed_ms = joined.attributed_ms.get(stage.name, 0.0)
        stage.ttft_share = joined.share.get(stage.name, 0.0)
        longest = joined.stall_max_ms.get(stage.name)
        if longest is not None:
            stage.stall_max_ms = longest


def slow_chain(slow: admin_pb2.SlowChain, figures: RequestTokens | None) -> None:
    """One of the slowest chains: its TTFT, owner, and each streaming stage's stream."""
    if figures is None:
        return
    if figures.ttft_s is not None:
        slow.ttft_ms = round(figures.ttft_s * 1000, 3)
    slow.ttft_owner = owner(figures.shares)
    streams = {s.stage: s for s in figures.streams}
    for stage in slow.stages:
        part = figures.shares.get(stage.name)
        if part is not None:
            stage.ttft_part_ms = round(part * 1000, 3)
        stream = streams.get(stage.name)
        if stream is not None:
            stage.stream.CopyFrom(stage_stream(stream))


def stage_stream(stream: StageStream) -> admin_pb2.StageStream:
    out = admin_pb2.StageStream(
        output_tokens=stream.tokens, tokens_per_s=stream.tokens_per_s,
        stall_count=stream.stall_count, end=stream.end,
        stalls=[admin_pb2.TokenStall(after_ms=after, length_ms=length)
                for after, length in stream.stalls])
    for name in ("ttft_ms", "itl_p50_ms", "itl_p99_ms"):
        value = getattr(stream, name)
        if value is not None:
            setattr(out, name, value)
    return out
