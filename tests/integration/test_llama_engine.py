"""A real LLM engine: llama-cpp-python's OpenAI-compatible server on CPU with a tiny
random-weight llama model the test writes (sitsmesh.dev.tinyllm). The official `openai`
client streams a chat completion from it directly, then through real Envoy with
sitsmesh's ext_proc fragment, and sitsmesh counts the tokens the client got. The engine
sends no usage chunk (it ignores stream_options.include_usage), so sitsmesh counts the
content events."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from sitsmesh.dev import harness
from sitsmesh.dev.tinyllm import llama_server, write_tiny_llama

pytestmark = pytest.mark.integration
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The engine's base URL; one server for the module."""
    importlib.import_module("llama_cpp")  # a test dependency: missing, fail, don't skip
    model = write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny.gguf")
    with llama_server(model) as base:
        yield base


def _stream(base_url: str) -> tuple[list[str], str | None, float]:
    """Stream one chat completion: its content pieces, finish_reason and the seconds it
    took."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    began = time.monotonic()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say something."}],
        stream=True, max_tokens=MAX_TOKENS, temperature=0)
    pieces: list[str] = []
    finish: str | None = None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return pieces, finish, time.monotonic() - began


def test_the_engine_streams_a_chat_completion(engine: str) -> None:
    pieces, finish, took = _stream(f"{engine}/v1")
    print(f"\n{len(pieces)} content chunks in {took * 1000:.0f} ms: {''.join(pieces)!r}")
    assert 3 <= len(pieces) <= MAX_TOKENS, pieces
    assert finish == "length"  # the tiny model never picks </s>: it runs to max_tokens


def test_sitsmesh_counts_the_engines_tokens_through_envoy(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh], engine: str) -> None:
    node = start_sitsmesh()
    port = urlsplit(engine).port
    assert port is not None
    envoy = harness.start_envoy(tmp_path, node.data_addr, port, fragments=["ext_proc"])
    try:
        pieces, finish, _ = _stream(envoy.url("/v1"))
        assert len(pieces) >= 3, pieces
        assert finish == "length"

        def metric(name: str) -> float:
            return harness.metric_value(node.metrics(), name, format="openai")

        harness.wait_until(
            lambda: metric("gen_ai_server_time_to_first_token_seconds_count") == 1, 10,
            "the stream's report")
        harness.wait_until(lambda: metric("sitsmesh_output_tokens_total") == len(pieces), 5,
                           f"sitsmesh to count {len(pieces)} tokens")
        assert metric("gen_ai_server_time_to_first_token_seconds_count") == 1
    finally:
        envoy.kill()
