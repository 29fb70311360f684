"""Per-message checks of a gRPC stream (README "Per-message checks of gRPC streams").

ext_authz checks a stream once, at its start, from its headers: who calls and whether
it may be admitted. The model of a ModelStreamInfer call is in each message, and a
long-lived bidirectional stream may name a new one in any of them, so every client
message is checked as it arrives: complete (its length prefix read whole), within the
size bound, uncompressed (a compressed message cannot be read), naming the stream's
first model, a model the tenant may call, and the caller's key or identity still valid
on the tenant directory as it is now. A message is forwarded only once it passed
(never a partial one); the first refused message ends the stream, and the messages
before it were forwarded and are answered.

A message whose bytes do not all arrive within the deadline follows the fail mode:
closed ends the stream (DEADLINE_EXCEEDED), open forwards it unchecked.
Pure logic: the caller (transport/streamcheck.py) carries the bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from google.rpc import code_pb2

from sitsmesh.authz.check import MODEL_STREAM_INFER, Authorizer, CheckInput, Denied
from sitsmesh.authz.extract import string_field
from sitsmesh.authz.model import Tenant
from sitsmesh.keyvalues import split_pairs

# gRPC streaming methods checked by default, and the protobuf field of the model name
# in each of their messages (ModelInferRequest.model_name).
DEFAULT_METHODS: Mapping[str, int] = {MODEL_STREAM_INFER: 1}
PREFIX = 5  # a gRPC message: compressed flag (1 byte), length (4 bytes, big-endian)
_STATUS = {401: code_pb2.UNAUTHENTICATED, 403: code_pb2.PERMISSION_DENIED}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a stream ends: a gRPC status code (google.rpc.Code: gRPC itself is not
    imported where settings are read, see tlsversion.py), a machine-readable code (as
    Check's deny codes) and a message for the caller."""

    status: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class StreamCheckSettings:
    methods: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_METHODS))
    max_message_bytes: int = 4 << 20
    deadline_s: float = 1.0
    fail_open: bool = False
    # Incomplete messages held across every open stream: a client that sends all but
    # the last byte of a 4 MiB message on each of a thousand streams would otherwise
    # hold 4 GB for the deadline. Past it, the stream that grew the total is ended.
    max_held_bytes: int = 64 << 20

    def field_of(self, path: str) -> int:
        """The model field of a checked method; 0 for one the settings do not name (gRPC
        paths are matched exactly, as Envoy routes them)."""
        return self.methods.get(path, 0)


def parse_methods(raw: Any) -> dict[str, int]:
    """`{"/pkg.Service/Method": FIELD}` in YAML, or `/pkg.Service/Method=FIELD,...`."""
    items = list(raw.items()) if isinstance(raw, dict) else split_pairs(str(raw), "path=field")
    methods: dict[str, int] = {}
    for path, number in items:
        if not isinstance(path, str) or path.count("/") != 2 or not path.startswith("/") \
                or "" in path[1:].split("/"):
            raise ValueError(f"{path!r}: a gRPC method path is /package.Service/Method")
        try:
            tag = int(number)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: the model's field number must be an integer, "
                             f"got {number!r}") from None
        if not 1 <= tag <= 536_870_911:
            raise ValueError(f"{path}: field number {tag} is not a protobuf field "
                             "number (1-536870911)")
        methods[path] = tag
    if not methods:
        raise ValueError("name at least one method")
    return methods


def parse_deadline(raw: Any) -> float:
    """Seconds a message may take to arrive whole: 0.01 to 60 (Envoy's stream idle
    timeout would end a stream that waits longer)."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number of seconds, got {raw!r}") from None
    if not 0.01 <= value <= 60:
        raise ValueError(f"must be between 0.01 and 60 seconds, got {value:g}")
    return value


def refusal_of(denied: Denied) -> Refusal:
    return Refusal(_STATUS.get(denied.status, code_pb2.PERMISSION_DENIED),
                   denied.code, denied.message)


class MessageGate:
    """One stream's checks. `identify` at its start, then `feed` each body chunk: it
    returns the bytes to forward and, once a message is refused, the refusal (the gate
    forwards nothing after it)."""

    __slots__ = ("_authorizer", "_buffer", "_caller", "_field", "_settings", "_tenant",
                 "_unchecked", "messages", "model", "pending_since", "refusal")

    def __init__(self, authorizer: Authorizer, settings: StreamCheckSettings,
                 caller: CheckInput, field: int) -> None:
        self._authorizer = authorizer
        self._settings = settings
        self._caller = caller  # the stream's headers and peer: identity, re-read each time
        self._field = field
        self._buffer = bytearray()
        self._unchecked = 0  # bytes of a message the fail-open deadline let through
        self._tenant: Tenant | None = None
        self.model = ""
        self.messages = 0
        self.pending_since: float | None = None  # when the incomplete message began
        self.refusal: Refusal | None = None

    @property
    def tenant(self) -> str:
        return self._tenant.name if self._tenant is not None else ""

    def identify(self) -> Refusal | None:
        """Who the stream's caller is now, and whether it may still use the stream's
        model: at the start, before each message, and when the directory changes."""
        found = self._authorizer.identify(self._caller)
        if isinstance(found, Denied):
            return self._refuse(refusal_of(found))
        self._tenant = found
        if self.model and not found.allows(self.model):
            return self._refuse(Refusal(code_pb2.PERMISSION_DENIED, "model_not_allowed",
                                        f"tenant {found.name} may no longer call model "
                                        f"{self.model}"))
        return None

    def feed(self, data: bytes, now: float) -> bytes:
        """The bytes of `data` to forward: whole messages that passed, and the rest of a
        message the deadline let through. Check `refusal` after."""
        if self.refusal is not None:
            return b""
        out = bytearray()
        if self._unchecked:
            passed = min(self._unchecked, len(data))
            out += data[:passed]
            self._unchecked -= passed
            data = data[passed:]
        buffer = self._buffer
        buffer += data
        pos = 0
        while len(buffer) - pos >= PREFIX:
            size = int.from_bytes(buffer[pos + 1:pos + PREFIX], "big")
            if buffer[pos] != 0:
                self._refuse(Refusal(code_pb2.INVALID_ARGUMENT, "message_compressed",
                                     f"message {self.messages + 1} is compressed and cannot "
                                     "be checked: send this stream's messages uncompressed"))
                break
            if size > self._settings.max_message_bytes:
                self._refuse(Refusal(code_pb2.RESOURCE_EXHAUSTED, "message_too_large",
                                     f"message {self.messages + 1} is {size} bytes, over the "
                                     f"{self._settings.max_message_bytes}-byte bound"))
                break
            end = pos + PREFIX + size
            if end > len(buffer):
                break
            if self._check(bytes(buffer[pos + PREFIX:end])) is not None:
                break
            out += buffer[pos:end]
            pos = end
        del buffer[:pos]
        if self.refusal is not None:
            buffer.clear()
        self.pending_since = (self.pending_since or now) if buffer else None
        return bytes(out)

    @property
    def held(self) -> int:
        """Bytes of an incomplete message held back."""
        return len(self._buffer)

    def busy(self) -> None:
        """Every stream together holds too much: this one ends."""
        self._refuse(Refusal(code_pb2.RESOURCE_EXHAUSTED, "server_busy",
                             "sitsmesh holds too many incomplete messages; send whole "
                             "messages, or retry later"))
        self.release()

    def release(self) -> None:
        self._buffer.clear()
        self.pending_since = None

    def overdue(self, now: float) -> bytes:
        """The incomplete message passed its deadline: refused (fail closed), or its
        bytes so far, and the rest as they come, forwarded unchecked (fail open)."""
        if self.pending_since is None or now - self.pending_since < self._settings.deadline_s:
            return b""
        self.pending_since = None
        if not self._settings.fail_open:
            self._refuse(Refusal(code_pb2.DEADLINE_EXCEEDED, "check_deadline",
                                 f"message {self.messages + 1} did not arrive whole within "
                                 f"the {self._settings.deadline_s:g} s check deadline"))
            self._buffer.clear()
            return b""
        buffer = self._buffer
        size = int.from_bytes(buffer[1:PREFIX], "big") if len(buffer) >= PREFIX else 0
        released = bytes(buffer)
        # Without the length prefix whole, the message's end is unknown: the rest of the
        # stream goes unchecked.
        self._unchecked = PREFIX + size - len(buffer) if size else (1 << 62)
        buffer.clear()
        self.messages += 1
        return released

    def _check(self, message: bytes) -> Refusal | None:
        number = self.messages + 1
        refused = self.identify()
        if refused is not None:
            return refused
        model = string_field(message, 0, len(message), self._field)
        if not model:
            return self._refuse(Refusal(code_pb2.PERMISSION_DENIED, "model_unknown",
                                        f"message {number} names no model"))
        if not self.model:
            tenant = self._tenant
            assert tenant is not None  # identify() passed just now
            if not tenant.allows(model):
                return self._refuse(Refusal(
                    code_pb2.PERMISSION_DENIED, "model_not_allowed",
                    f"tenant {tenant.name} may not call model {model}"))
            self.model = model
        elif model != self.model:
            return self._refuse(Refusal(
                code_pb2.PERMISSION_DENIED, "model_mixed",
                f"message {number} names model {model}; this stream's model is {self.model}"))
        self.messages = number
        return None

    def _refuse(self, refusal: Refusal) -> Refusal:
        if self.refusal is None:
            self.refusal = refusal
        return self.refusal
