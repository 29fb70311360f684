"""Tokens per event for each wire format, and one stream's timing (pure: a fed clock)."""

from __future__ import annotations

import json

import pytest

from sitsmesh.tokens.formats import DONE, FORMATS, Piece, Usage, ndjson, openai, triton
from sitsmesh.tokens.timing import MAX_GAPS, End, StreamClock


def _chat(delta: dict[str, object]) -> bytes:
    return json.dumps({"object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta}]}).encode()


def test_openai_chat_and_completions_events() -> None:
    assert openai(_chat({"role": "assistant", "content": ""})) == Piece(0)  # before tokens
    assert openai(_chat({"content": "Hel"})) == Piece(1)
    assert openai(_chat({"reasoning_content": "hmm"})) == Piece(1)
    assert openai(_chat({"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]})) \
        == Piece(1)
    assert openai(json.dumps({"object": "text_completion", "choices": [
        {"index": 0, "text": " a"}, {"index": 1, "text": " b"}]}).encode()) == Piece(2)
    assert openai(b"[DONE]") is DONE
    usage = {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52,
             "prompt_tokens_details": {"cached_tokens": 8}}
    last = json.dumps({"object": "chat.completion.chunk", "choices": [], "usage": usage})
    assert openai(last.encode()) == Piece(0, usage=Usage(12, 40, 8))


@pytest.mark.parametrize("data", [b"{not json", b"\xff\xfe", b"[1, 2]", b"[" * 100_000])
def test_bad_openai_events_say_why(data: bytes) -> None:
    piece = openai(data)
    assert piece.error and piece.tokens == 0 and not piece.done


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16-le", "utf-16-be", "utf-32"])
def test_json_in_other_encodings_reads_as_json_loads_reads_it(encoding: str) -> None:
    # Events are parsed without json.loads's encoding sniffing where they are plain
    # UTF-8; the others still read as json.loads reads them.
    assert openai(_chat({"content": "Hel"}).decode().encode(encoding)) == Piece(1)


def test_an_engine_error_event_ends_the_stream() -> None:
    piece = openai(b'{"error": {"message": "KV cache full", "code": 503}}')
    assert piece.done and "KV cache full" in piece.error


def test_triton_generate_stream_events() -> None:
    assert triton(b'{"model_name":"llm","model_version":"1","text_output":"tok"}') == Piece(1)
    assert triton(b'{"model_name":"llm","text_output":""}') == Piece(0)
    assert triton(b'{"error":"model failed"}').done


def test_ndjson_ollama_events() -> None:
    assert ndjson(b'{"response":"a","done":false}') == Piece(1)
    assert ndjson(b'{"message":{"role":"assistant","content":"b"},"done":false}') == Piece(1)
    assert ndjson(b'{"response":"","done":true,"prompt_eval_count":5,"eval_count":9}') == \
        Piece(0, done=True, usage=Usage(5, 9))
    assert set(FORMATS) == {"openai", "triton", "ndjson", "triton-grpc"}


def test_ttft_itl_and_throughput_from_content_events() -> None:
    clock = StreamClock(started=100.0, stall_s=1.0)
    assert clock.tokens(0, 100.05) is None  # a role delta: not the first token
    clock.tokens(1, 100.30)
    for i in range(1, 11):
        clock.tokens(1, 100.30 + 0.02 * i)
    summary = clock.summary(End.COMPLETE, 100.6)
    assert summary.ttft_s == pytest.approx(0.30)
    assert summary.itl_p50_s == pytest.approx(0.02)
    assert summary.tokens == 11
    assert summary.tokens_per_s == pytest.approx(50.0)
    assert summary.stalls == () and summary.end is End.COMPLETE


def test_a_gap_past_the_threshold_is_a_stall_and_so_is_dying_after_one() -> None:
    clock = StreamClock(started=0.0, stall_s=0.5)
    clock.tokens(1, 0.1)
    clock.tokens(1, 0.2)
    stall = clock.tokens(1, 2.2)
    assert stall is not None and stall.after_s == 0.2
    assert stall.length_s == pytest.approx(2.0)
    summary = clock.summary(End.UPSTREAM_RESET, 5.0)
    assert summary.stall_count == 2  # the mid-stream stall, and the silence before the reset
    assert summary.stalls[1].after_s == 2.2
    assert summary.stalls[1].length_s == pytest.approx(2.8)


def test_usage_overrides_the_event_count_and_no_token_means_no_ttft() -> None:
    clock = StreamClock(started=0.0, stall_s=1.0)
    clock.tokens(2, 0.1)
    assert clock.summary(End.COMPLETE, 0.2, tokens=7).tokens == 7
    empty = StreamClock(started=0.0, stall_s=1.0).summary(End.CLIENT_ABORT, 3.0)
    assert empty.ttft_s is None and empty.itl_p50_s is None and empty.stall_count == 0


def test_a_long_stream_keeps_a_bounded_uniform_sample_of_its_gaps() -> None:
    clock = StreamClock(started=0.0, stall_s=10.0)
    at = 0.0
    for i in range(20_000):
        at += 0.01 if i % 100 else 0.5  # one slow token in a hundred
        clock.tokens(1, at)
    assert len(clock._gaps) <= MAX_GAPS
    summary = clock.summary(End.COMPLETE, at)
    assert summary.itl_p50_s == pytest.approx(0.01)
    assert summary.itl_p99_s == pytest.approx(0.5)  # the slow 1 % survives the thinning


def test_triton_grpc_stream_responses() -> None:
    from tritonclient.grpc import service_pb2

    from sitsmesh.tokens.formats import triton_grpc

    token = service_pb2.ModelStreamInferResponse()
    token.infer_response.raw_output_contents.append(b"\x03\x00\x00\x00 t0")
    assert triton_grpc(token.SerializeToString()) == Piece(1)
    final = service_pb2.ModelStreamInferResponse()
    final.infer_response.parameters["triton_final_response"].bool_param = True
    assert triton_grpc(final.SerializeToString()) == Piece(0, done=True)
    failed = service_pb2.ModelStreamInferResponse(error_message="model crashed")
    assert triton_grpc(failed.SerializeToString()).done
    assert triton_grpc(b"\xff\xff\xff").error
