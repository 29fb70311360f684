"""W3C trace context: the trace id of a `traceparent` header, read strictly.

The header comes from the client (or the mesh) through Envoy's access log, so
anything but the exact version-00 shape is ignored rather than stored: the
chain then simply has no trace id. See https://www.w3.org/TR/trace-context/.
"""

from __future__ import annotations

import re

HEADER = "traceparent"
# version "00" is exactly 2 + 1 + 32 + 1 + 16 + 1 + 2 characters; later versions may
# append fields, but we only read the version we know.
LENGTH = 55
_SHAPE = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32
_ZERO_PARENT = "0" * 16


def trace_id(traceparent: str) -> str:
    """The 32-hex trace id, or "" when the value is not a valid version-00 traceparent.

    The length is checked before the pattern, so a long value costs one len().
    """
    if len(traceparent) != LENGTH:
        return ""
    shape = _SHAPE.fullmatch(traceparent)
    if shape is None:
        return ""
    trace, parent = shape.group(1, 2)
    if trace == _ZERO_TRACE or parent == _ZERO_PARENT:
        return ""
    return trace


_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def valid_trace_id(value: str) -> bool:
    """A trace id as trace_id() returns it (for ids that crossed another process)."""
    return len(value) == 32 and value != _ZERO_TRACE and _TRACE_ID.fullmatch(value) is not None
