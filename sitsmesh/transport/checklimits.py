"""Bounds on a Check request, judged before its headers are read: a precise deny, cheaply.

A Check bigger than `max_check_message_bytes` is refused in the deserializer
from its length alone, unparsed (413); one with more headers or header bytes
than allowed gets a 431. Either way the caller learns which bound it crossed,
and the request never reaches identity or policy, so it is never admitted.
The body travels inside the message, so the message bound is the body bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2
from envoy.type.v3 import http_status_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_MAX_HEADERS = 128
DEFAULT_MAX_HEADER_BYTES = 64 << 10


class _Refused:
    """Stands in for a Check request refused in the deserializer; `reason` is the deny's
    code."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_TOO_LARGE = _Refused("request_too_large")
_MALFORMED = _Refused("malformed_check")
_MANY = _Refused("too_many_headers")
_WIDE = _Refused("headers_too_large")


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _deny(status: int, code: str, message: str, rpc_code: int = code_pb2.INVALID_ARGUMENT,
          retry_after_s: int = 0) -> Any:
    headers = [_header("content-type", "application/json")]
    body: dict[str, Any] = {"code": code, "message": message}
    if retry_after_s:
        headers.append(_header("retry-after", str(retry_after_s)))
        body["retry_after_s"] = retry_after_s
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=rpc_code, message=message),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=status), headers=headers,
            body=json.dumps(body)))


BUSY = "server_busy"


def busy(why: str, context: Any) -> Any:
    """The deny of a Check the in-flight byte budget refused (sitsmesh/transport/budget.py).

    A deny, not a gRPC error: Envoy's ext_authz turns an error into its
    `status_on_error` (403 unless set) or, with failure_mode_allow, lets the request
    through unchecked; a 503 with Retry-After tells the client what happened, as a shed
    request's 429 does, whatever the filter's failure mode."""
    del context
    reply = _BUSY_REPLIES.get(why)
    if reply is None:  # the budget words each refusal the same way: a few replies
        reply = _BUSY_REPLIES[why] = _deny(503, BUSY, why, code_pb2.RESOURCE_EXHAUSTED,
                                           retry_after_s=1)
    return reply


_BUSY_REPLIES: dict[str, Any] = {}


class CheckLimits:
    """Judged in the deserializer, where the message's length is known for free: the
    header bytes are counted only in a message long enough to hold too many."""

    __slots__ = ("_max_header_bytes", "_max_headers", "_replies", "max_message_bytes")

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_headers: int = DEFAULT_MAX_HEADERS,
                 max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> None:
        self.max_message_bytes = max_message_bytes
        self._max_headers = max_headers
        self._max_header_bytes = max_header_bytes
        # Built once: a flood of refused requests costs no allocation per reply.
        self._replies = {
            _TOO_LARGE: _deny(413, _TOO_LARGE.reason,
                              f"request (headers and body) over {max_message_bytes} bytes"),
            _MALFORMED: _deny(400, _MALFORMED.reason, "the CheckRequest could not be parsed"),
            _MANY: _deny(431, _MANY.reason, f"more than {max_headers} headers"),
            _WIDE: _deny(431, _WIDE.reason, f"headers over {max_header_bytes} bytes"),
        }

    def deserializer(self) -> Callable[[bytes], Any]:
        limit, parse = self.max_message_bytes, external_auth_pb2.CheckRequest.FromString
        judge = self._judge

        def deserialize(data: bytes) -> Any:
            size = len(data)
            if size > limit:
                return _TOO_LARGE
            # grpc would answer a parse failure with UNKNOWN; Envoy deserves a deny.
            try:
                request = parse(data)
            except DecodeError:
                return _MALFORMED
            return judge(request, size)

        return deserialize

    def _judge(self, request: Any, size: int) -> Any:
        http = request.attributes.request.http
        headers = http.headers
        count = len(headers)
        listed = http.header_map.headers if http.HasField("header_map") else ()
        if count + len(listed) > self._max_headers:
            return _MANY
        if size <= self._max_header_bytes:
            return request  # the whole message fits in the bound, its headers too
        wide = sum(map(len, headers)) + sum(map(len, headers.values()))
        for header in listed:
            wide += len(header.key) + len(header.value) + len(header.raw_value)
        return _WIDE if wide > self._max_header_bytes else request

    def screen(self, request: Any) -> Any | None:
        """The deny for a request refused in the deserializer, or None."""
        if type(request) is _Refused:
            return self._replies[request]
        return None

    @staticmethod
    def refusal(request: Any) -> str:
        """The deny code of a request `screen` refused."""
        return str(request.reason)
