"""What a request is: its route (normalized) and model, from KServe v2 paths, gRPC
GRPCInferenceService bodies and OpenAI JSON.

Deny by default: a path is first normalized the way a backend might read it
(query cut, percent-escapes decoded once, `//`, `.`, `..` and a trailing slash
resolved, fixed segments matched case-insensitively); a normalized path that
names no known route is refused, never passed through as "no model".
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

MAX_JSON_BODY = 1 << 20
MAX_MODEL_NAME = 256

# Refusals returned in place of a request class; check.py turns each into a Denied.
INVALID_PATH = "!invalid_path"        # cannot be normalized (bad escape, control char, ...)
CONTROL_API = "!control_api"          # Triton repository/control APIs: never for tenants
UNKNOWN_ROUTE = "!unknown_route"      # normalized, and still nothing we know
DUPLICATE_KEY = "!duplicate_key"      # an OpenAI body with a key given twice
MIXED_MODELS = "!mixed_models"        # a gRPC stream whose messages name different models

# Printable ASCII minus what a backend could read as a separator once decoded.
_SAFE_PATH = re.compile(r"/[!$&'()*+,\-./0-9:;=@A-Z\[\]^_`a-z{|}~]*")
_KSERVE = re.compile(
    r"^/v2/models/(?P<model>[^/]+)(?:/versions/[^/]+)?/"
    r"(?P<verb>infer|generate|generate_stream)$", re.IGNORECASE)
# Checked before the metadata routes: /v2/models/stats is Triton's statistics for
# every model, not the metadata of a model named "stats".
_CONTROL = re.compile(
    r"^/v2/(?:repository|systemsharedmemory|cudasharedmemory|trace|logging)(?:/|$)"
    r"|^/v2/models/stats$"
    r"|^/v2/models/[^/]+(?:/versions/[^/]+)?/(?:config|stats|trace)(?:/|$)", re.IGNORECASE)
_KSERVE_META = re.compile(r"^/v2/models/(?P<model>[^/]+)(?:/versions/[^/]+)?(?:/ready)?$",
                          re.IGNORECASE)
_SERVER_META = re.compile(r"^/v2(?:/health/(?:live|ready))?$", re.IGNORECASE)
_OPENAI = re.compile(r"^/v1/(?:chat/completions|completions|embeddings|responses)$",
                     re.IGNORECASE)
_OPENAI_MODEL = re.compile(r"^/v1/models/(?P<model>.+)$", re.IGNORECASE)

_GRPC_PREFIX = "/inference.grpcinferenceservice/"
# Methods a tenant may call, by lower-cased path; every other method of the
# service (Repository*, ModelConfig, ModelStatistics, *SharedMemory*,
# TraceSetting, LogSettings) is a control API. ModelConfig is one too: it shows
# the operator's deployment (backend, parameters, instance groups), and
# ModelMetadata already tells a caller the inputs and outputs it needs.
_GRPC_BODY_CLASS = {
    "modelinfer": "grpc", "modelstreaminfer": "grpc",
    "modelready": "metadata", "modelmetadata": "metadata",
}
_GRPC_NO_MODEL = frozenset(("serverlive", "serverready", "servermetadata"))


def normalize(path: str) -> str:
    """The path as a lenient backend would read it; "" when it cannot be read at all."""
    end = len(path)
    for stop in ("?", "#"):
        cut = path.find(stop)
        if 0 <= cut < end:
            end = cut
    if end != len(path):
        path = path[:end]
    if "%" in path:
        try:
            path = unquote(path, errors="strict")
        except UnicodeDecodeError:
            return ""
    if not _SAFE_PATH.fullmatch(path):
        return ""  # an undecodable escape ('%' left), '\', '?', '#', space, non-ASCII
    if "//" in path or "/." in path or (len(path) > 1 and path[-1] == "/"):
        segments: list[str] = []
        for segment in path.split("/"):
            if segment == "..":
                if segments:
                    segments.pop()
            elif segment and segment != ".":
                segments.append(segment)
        path = "/" + "/".join(segments)
    return path


def _grpc_models(body: bytes) -> str:
    """`model_name` / `name` (field 1) of every gRPC frame in the body: the model,
    "" when a frame is malformed, compressed or names none, MIXED_MODELS when the
    frames disagree.

    Envoy's ext_authz sends the buffered body once the client ends its stream (or,
    cut short, with x-envoy-auth-partial-body), so every message of a
    ModelStreamInfer stream is here. Reading one length-delimited field needs a
    dozen lines; importing Triton's generated protos into the request path would
    cost far more. Protobuf keeps the last occurrence of a repeated scalar field,
    so this does too: a second model_name cannot smuggle a different model past
    the check.
    """
    pos, size, model = 0, len(body), ""
    while pos < size:
        if size - pos < 5 or body[pos] != 0:  # compressed frames are not inspected
            return ""
        end = pos + 5 + int.from_bytes(body[pos + 1:pos + 5], "big")
        if end > size:
            return ""
        found = string_field(body, pos + 5, end)
        if not found:
            return ""
        if model and found != model:
            return MIXED_MODELS
        model, pos = found, end
    return model


def string_field(body: bytes, pos: int, end: int, number: int = 1) -> str:
    """The last value of string field `number` in the protobuf message body[pos:end];
    "" when it has none, or the message cannot be read (a fixed-width field included:
    ModelInferRequest has none)."""
    found = ""
    while pos < end:
        tag, pos = _varint(body, pos, end)
        if tag < 0:
            return ""
        field, wire = tag >> 3, tag & 7
        if wire == 2:
            length, pos = _varint(body, pos, end)
            if length < 0 or pos + length > end:
                return ""
            if field == number:
                try:
                    found = body[pos:pos + length].decode()
                except UnicodeDecodeError:
                    return ""
            pos += length
        elif wire == 0:
            _, pos = _varint(body, pos, end)
            if pos < 0:
                return ""
        else:
            return ""
    return found


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return -1, -1


def _openai(body: bytes) -> tuple[str, str, bool]:
    if not body or len(body) > MAX_JSON_BODY:
        return "", "openai", True
    try:
        # Objects as lists of pairs (the hook is C, so this costs about what dicts
        # do): parsers disagree on which of two equal keys wins (Python keeps the
        # last, some keep the first), so a top-level key given twice, where "model"
        # and "stream" are read, is refused rather than read one way here and
        # another way by the backend.
        pairs: Any = json.loads(body, object_pairs_hook=list)
    except (ValueError, RecursionError):
        return "", "openai", True
    if not isinstance(pairs, list) or not all(isinstance(p, tuple) for p in pairs):
        return "", "openai", True  # a JSON array, or a scalar: no model in it
    doc = dict(pairs)
    if len(doc) != len(pairs):
        return "", DUPLICATE_KEY, True
    model = doc.get("model")
    if isinstance(model, str):
        return model[:MAX_MODEL_NAME], "stream" if doc.get("stream") is True else "openai", True
    return "", "openai", True


def classify(path: str, body: bytes) -> tuple[str, str, bool]:
    """(model, request class, whether the model comes from the body), or
    ("", refusal, False) with one of the refusals above.

    Classes: infer, generate, stream, grpc, openai and metadata (health and
    metadata routes: the model they ask about, or "" for the server's own). A
    model read from the body is "" when the body does not name one.
    """
    path = normalize(path)
    if not path:
        return "", INVALID_PATH, False
    match = _KSERVE.match(path)
    if match:
        verb = match.group("verb").lower()
        return match.group("model")[:MAX_MODEL_NAME], \
            "stream" if verb == "generate_stream" else verb, False
    lowered = path.lower()
    if lowered.startswith(_GRPC_PREFIX):
        method = lowered[len(_GRPC_PREFIX):]
        request_class = _GRPC_BODY_CLASS.get(method)
        if request_class is not None:
            model = _grpc_models(body)
            if model == MIXED_MODELS:
                return "", MIXED_MODELS, False
            return model[:MAX_MODEL_NAME], request_class, True
        return ("", "metadata", False) if method in _GRPC_NO_MODEL else ("", CONTROL_API, False)
    if _OPENAI.match(path):
        return _openai(body)
    if _CONTROL.match(path):
        return "", CONTROL_API, False
    match = _KSERVE_META.match(path) or _OPENAI_MODEL.match(path)
    if match:
        return match.group("model")[:MAX_MODEL_NAME], "metadata", False
    if _SERVER_META.match(path):
        return "", "metadata", False
    return "", UNKNOWN_ROUTE, False


def open_path(path: str) -> str:
    """An operator's open path, validated: normalized, and outside every route that
    is checked by model or refused (config parsing calls this)."""
    if normalize(path) != path or classify(path, b"")[1] != UNKNOWN_ROUTE or \
            path.lower().startswith(("/v1/", "/v2/", "/inference.")):
        raise ValueError(f"{path!r}: an open path is a normalized path (no query, '//', "
                         "'.', '..' or trailing '/') outside /v1/, /v2/ and /inference.")
    return path
