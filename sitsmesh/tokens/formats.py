"""What one event of a streaming response says about tokens, per wire format.

Engines stream about a token an event (llama.cpp's server one, vLLM one per engine step
unless it speculates), so without a tokenizer an event that carries new text counts as
one token per choice. A final `usage` (vLLM with `stream_options.include_usage`,
OpenAI) gives the true counts and overrides the event count at the stream's end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Piece:
    """One event: the output tokens it carries, whether it ends the stream, the usage
    it reports and, for an event that is not what its format says, why."""

    tokens: int = 0
    done: bool = False
    usage: Usage | None = None
    error: str = ""


NOTHING = Piece()
ONE = Piece(1)
DONE = Piece(done=True)
_decode = json.JSONDecoder().decode


def _loads(data: bytes) -> Any:
    """json.loads(data), without its encoding sniffing where the bytes are plainly UTF-8:
    an ASCII first byte (no BOM) and no NUL in the first two (UTF-16/32 JSON has one)."""
    if len(data) > 1 and 0 < data[0] < 0x80 and data[1]:
        return _decode(data.decode("utf-8", "surrogatepass"))
    return json.loads(data)


def _object(data: bytes, what: str = "an event", sender: str = "") -> dict[str, Any] | Piece:
    """The event's JSON object, or the Piece that says why there is none: not JSON, not
    an object, or (where `sender` names who sends them) an `error` object, which ends
    the stream."""
    try:
        body = _loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return Piece(error=f"not JSON: {data[:40]!r}")
    if not isinstance(body, dict):
        return Piece(error=f"{what} that is not a JSON object")
    if sender and "error" in body:
        return Piece(done=True, error=f"{sender} sent an error: {str(body['error'])[:80]}")
    return body


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else 0


def _openai_usage(raw: Any) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    return Usage(_count(raw.get("prompt_tokens")), _count(raw.get("completion_tokens")),
                 cached)


def _has_text(choice: Mapping[str, Any]) -> bool:
    """A completions choice's `text`, or a chat delta's content, reasoning, refusal or
    tool-call arguments: every one of them is generated tokens."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if delta.get("content") or delta.get("reasoning_content") or delta.get("refusal"):
        return True
    calls = delta.get("tool_calls")
    return isinstance(calls, list) and any(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and c["function"].get("arguments") for c in calls)


def openai(data: bytes) -> Piece:
    """An OpenAI-compatible `chat.completion.chunk` or `text_completion` event."""
    if data == b"[DONE]":
        return DONE
    body = _object(data, sender="the engine")
    if isinstance(body, Piece):
        return body
    choices = body.get("choices")
    tokens = 0
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and _has_text(choice):
                tokens += 1
    usage = body.get("usage")
    if usage is None and tokens < 2:  # the usual event: a shared Piece, none built
        return ONE if tokens else NOTHING
    return Piece(tokens, usage=_openai_usage(usage))


def triton(data: bytes) -> Piece:
    """A Triton `generate_stream` event: `text_output` per response of a decoupled
    model; an `error` object ends the stream."""
    body = _object(data, sender="Triton")
    if isinstance(body, Piece):
        return body
    return Piece(1 if body.get("text_output") else 0)


def ndjson(data: bytes) -> Piece:
    """A line of Ollama's shape: `response` (generate) or `message.content` (chat), and
    `done` with `prompt_eval_count` / `eval_count` on the last."""
    body = _object(data, "a line")
    if isinstance(body, Piece):
        return body
    message = body.get("message")
    text = body.get("response") or (message.get("content")
                                    if isinstance(message, dict) else None)
    done = body.get("done") is True
    usage = Usage(_count(body.get("prompt_eval_count")), _count(body.get("eval_count"))) \
        if done and "eval_count" in body else None
    return Piece(1 if text else 0, done=done, usage=usage)


def triton_grpc(data: bytes) -> Piece:
    """A Triton `ModelStreamInferResponse`: a response with output content is a token;
    `triton_final_response` ends the stream; `error_message` ends it with an error."""
    # Imported here: tritonclient's grpc stubs load only where gRPC streams are parsed.
    from tritonclient.grpc import service_pb2

    message = service_pb2.ModelStreamInferResponse()
    try:
        message.ParseFromString(data)
    except DecodeError:
        return Piece(error="not a ModelStreamInferResponse")
    if message.error_message:
        return Piece(done=True, error=f"Triton sent an error: {message.error_message[:80]}")
    response = message.infer_response
    final = response.parameters.get("triton_final_response")
    done = final is not None and final.bool_param
    has_output = any(response.raw_output_contents) or any(
        o.HasField("contents") for o in response.outputs)
    return Piece(1 if has_output else 0, done=done)


FORMATS: Mapping[str, Callable[[bytes], Piece]] = {
    "openai": openai, "triton": triton, "ndjson": ndjson, "triton-grpc": triton_grpc}
