"""Which model a request is for: KServe v2 paths, gRPC ModelInfer bodies, OpenAI JSON."""

from __future__ import annotations

import json
import re

_KSERVE = re.compile(
    r"^/v2/models/(?P<model>[^/?#]+)(?:/versions/[^/?#]+)?/"
    r"(?P<verb>infer|generate|generate_stream)(?:[?#].*)?$")
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
_OPENAI = re.compile(r"^/v1/(?P<kind>chat/completions|completions|embeddings|responses)"
                     r"(?:[?#].*)?$")
MAX_JSON_BODY = 1 << 20
MAX_MODEL_NAME = 256


def _grpc_model_name(body: bytes) -> str:
    """`model_name` (field 1) of a gRPC-framed ModelInferRequest.

    Reading one length-delimited field needs a dozen lines; importing Triton's
    generated protos into the request path would cost far more. Protobuf keeps
    the last occurrence of a repeated scalar field, so this does too: a second
    model_name cannot smuggle a different model past the check. Anything
    malformed yields "".
    """
    if len(body) < 5 or body[0] != 0:  # compressed frames are not inspected
        return ""
    pos, end = 5, min(len(body), 5 + int.from_bytes(body[1:5], "big"))
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
            if field == 1:
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


def model_and_class(path: str, body: bytes) -> tuple[str, str]:
    """(model, request class). No model found: ("", "other")."""
    match = _KSERVE.match(path)
    if match:
        verb = match.group("verb")
        return match.group("model")[:MAX_MODEL_NAME], "stream" if verb == "generate_stream" \
            else verb
    if path == GRPC_INFER:
        return _grpc_model_name(body)[:MAX_MODEL_NAME], "grpc"
    match = _OPENAI.match(path)
    if match:
        if not body or len(body) > MAX_JSON_BODY:
            return "", "openai"
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return "", "openai"
        model = doc.get("model") if isinstance(doc, dict) else None
        stream = isinstance(doc, dict) and doc.get("stream") is True
        if isinstance(model, str):
            return model[:MAX_MODEL_NAME], "stream" if stream else "openai"
        return "", "openai"
    return "", "other"
