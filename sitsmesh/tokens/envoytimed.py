"""Token streams timed inside Envoy (filters/fragments/token_timing.yaml, a Lua filter):
the filter leaves each stream's timing in dynamic metadata, its access-log entry carries
it here, and this turns it into the TokenReport the ext_proc observer would have made.

The filter's fields (namespace `sitsmesh.tokens`), times in Envoy's wall-clock
microseconds, as the entry's start_time is:
- `f` the format; `t0` when the first content token came and `k0` how many it was;
- `g` the gaps before each later event, comma-separated, `gap*k` for an event of k
  tokens (at most MAX_GAPS; written every 250 ms and at the end);
- `n` the tokens counted so far and `tl` when the last came (written on every chunk
  that has tokens, so a stream cut between two writes of `g` still counts every token;
  those past `g` are counted, not timed);
- `te` and `end` (`done`: its format's end, `body`: the body's end) once it ended
  whole; absent, the stream was cut and the entry's response flags say how;
- `u` usage ("prompt,completion,cached"), `bad` unreadable events, `err` an engine
  error event.
A completion that does not stream has `f` "json" and only `u`, `te` and `end`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sitsmesh.budgets.model import ESTIMATE_HEADER, estimate_from_header
from sitsmesh.tokens.formats import FORMATS, Usage
from sitsmesh.tokens.stream import TokenReport
from sitsmesh.tokens.timing import End, StreamClock

NAMESPACE = "sitsmesh.tokens"
# A completion that did not stream: only its usage (`u`) is known, for token budgets;
# it is no token stream and goes into no stream figure.
JSON = "json"
MAX_GAPS = 4096  # as the Lua filter's bound
MAX_GAPS_TEXT = MAX_GAPS * 24  # a gap is at most ~20 characters
# What Envoy's response flags say about a stream its filter did not see end.
_ENDS = (("stream_idle_timeout", End.IDLE_TIMEOUT),
         ("downstream_connection_termination", End.CLIENT_ABORT),
         ("downstream_remote_reset", End.CLIENT_ABORT),
         ("upstream_remote_reset", End.UPSTREAM_RESET),
         ("upstream_connection_termination", End.UPSTREAM_RESET),
         ("upstream_request_timeout", End.UPSTREAM_RESET),
         ("upstream_max_stream_duration_reached", End.UPSTREAM_RESET),
         ("upstream_protocol_error", End.UPSTREAM_RESET))


class Unreadable(ValueError):
    """The metadata is not what the filter writes."""


def timed(entry: Any) -> Any | None:
    """The entry's `sitsmesh.tokens` fields (a Struct's field map), or None."""
    metadata = entry.common_properties.metadata.filter_metadata
    if not metadata:
        return None
    struct = metadata.get(NAMESPACE)
    return struct.fields if struct is not None and "f" in struct.fields else None


def report(entry: Any, fields: Any, stall_of: Callable[[str, str], float]) -> TokenReport:
    """The entry's stream as a TokenReport; Unreadable where the fields are not the
    filter's."""
    fmt = _text(fields, "f", 16)
    if fmt not in FORMATS and fmt != JSON:
        raise Unreadable(f"format {fmt!r}")
    common = entry.common_properties
    start_us = common.start_time.seconds * 1_000_000 + common.start_time.nanos // 1000
    cluster, route = common.upstream_cluster, common.route_name
    clock = StreamClock(0.0, stall_of(cluster, route))
    n = _count(fields, "n")
    if "t0" in fields:
        at = (_count(fields, "t0") - start_us) / 1e6
        covered = _count(fields, "k0")
        clock.tokens(covered, at)
        gaps = _text(fields, "g", MAX_GAPS_TEXT)
        for item in gaps.split(",")[:MAX_GAPS] if gaps else ():
            gap, _, k = item.partition("*")
            # At most 12 digits each (a gap of 11 days in microseconds): the int() of a
            # sender's 90 000-digit "gap" would cost the loop.
            if not (gap.isdigit() and len(gap) <= 12
                    and (not k or (k.isdigit() and len(k) <= 12 and int(k) >= 1))):
                raise Unreadable(f"gap {item[:24]!r}")
            count = int(k) if k else 1
            at += int(gap) / 1e6
            clock.tokens(count, at)
            covered += count
        if n > covered:  # counted after the last write of the gaps, or past MAX_GAPS
            clock.untimed(n - covered, (_count(fields, "tl") - start_us) / 1e6)
    usage = _usage(fields)
    end = _end(fields, common.response_flags)
    if end is End.COMPLETE:
        if fields["err"].bool_value if "err" in fields else False:
            end = End.ERROR
        ended = (_count(fields, "te") - start_us) / 1e6
    else:
        duration = common.duration
        ended = duration.seconds + duration.nanos / 1e9
    summary = clock.summary(end, max(ended, 0.0),
                            usage.completion_tokens if usage is not None else None)
    request = entry.request
    logged = request.request_headers  # access_log.yaml logs these
    return TokenReport(request.request_id, request.path[:256], fmt, summary, usage,
                       _count(fields, "bad"), cluster, route,
                       logged.get("x-sits-tenant", "")[:64],
                       estimate_from_header(logged.get(ESTIMATE_HEADER, "")),
                       logged.get("x-sits-model", "")[:256])


def _end(fields: Any, flags: Any) -> End:
    if "end" in fields:
        return End.COMPLETE
    for name, end in _ENDS:
        if getattr(flags, name):
            return end
    return End.CUT


def _usage(fields: Any) -> Usage | None:
    raw = _text(fields, "u", 64)
    if not raw:
        return None
    parts = raw.split(",")
    if len(parts) != 3 or not all(p.isdigit() and len(p) < 13 for p in parts):
        raise Unreadable(f"usage {raw!r}")
    return Usage(int(parts[0]), int(parts[1]), int(parts[2]))


def _text(fields: Any, name: str, limit: int) -> str:
    value = fields.get(name)
    if value is None:
        return ""
    if value.WhichOneof("kind") != "string_value" or len(value.string_value) > limit:
        raise Unreadable(f"{name} is not a string of at most {limit}")
    return str(value.string_value)


def _count(fields: Any, name: str) -> int:
    value = fields.get(name)
    if value is None:
        return 0
    number = value.number_value
    if value.WhichOneof("kind") != "number_value" or not 0 <= number < 1 << 53 \
            or number != int(number):
        raise Unreadable(f"{name} is not a count")
    return int(number)
