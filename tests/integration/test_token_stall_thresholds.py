"""A stage's own stall threshold through real Envoy (ext_proc) to real sitsmesh: the
stage that set `stall_ms: 300` counts a 500 ms gap as a stall; a stage on the 1 s
default, same engine, same gap, does not."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sitsmesh.dev import envoyconf, harness
from sitsmesh.dev.tokenstage import TokenStage, read_tokens

pytestmark = pytest.mark.integration
TOKENS = 6
# After the 3rd token the stage waits ITL + STALL: a 500 ms gap.
ITL_MS, STALL_MS = 20, 480
PIPELINES = """name: tight
models: ['tight']
stages:
  - {name: llm, match: {upstream_cluster: tight}, stall_ms: 300}
---
name: loose
models: ['loose']
stages:
  - {name: llm, match: {upstream_cluster: upstream}}
"""


@pytest.fixture
def stage() -> Iterator[TokenStage]:
    served = TokenStage(ttft_s=0.05, itl_s=ITL_MS / 1000, tokens=TOKENS).start()
    yield served
    served.stop()


def _stream(port: int, path: str) -> int:
    """A streaming chat request with a 500 ms gap; the content events read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, body=b'{"stream": true}', headers={
        "content-type": "application/json", "x-stage-stall-after": "3",
        "x-stage-stall-ms": str(STALL_MS)})
    read = read_tokens(conn.getresponse())
    conn.close()
    return read


def test_a_configured_300_ms_threshold_counts_a_gap_the_default_does_not(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh],
        stage: TokenStage) -> None:
    node = start_sitsmesh()
    for i, doc in enumerate(PIPELINES.split("---\n")):
        (tmp_path / f"p{i}.yaml").write_text(doc)
        applied = node.cli("pipelines", "apply", str(tmp_path / f"p{i}.yaml"))
        assert applied.returncode == 0, applied.stderr
    # A bad threshold is refused by name and changes nothing (at 5 ms every 20 ms gap
    # would be a stall too: one stall below says 300 ms still holds).
    tight = PIPELINES.split("---\n", maxsplit=1)[0]
    (tmp_path / "bad.yaml").write_text(tight.replace("300", "5"))
    refused = node.cli("pipelines", "apply", str(tmp_path / "bad.yaml"))
    assert refused.returncode != 0
    assert "stages[0].stall_ms must be a number of milliseconds from 10 to 60000" in \
        refused.stderr

    # One Envoy, two routes to the same engine: /v1/ to cluster tight, the rest to the
    # template's upstream.
    envoy = harness.start_envoy(
        tmp_path, node.data_addr, stage.port, fragments=["ext_proc"],
        edit=lambda bootstrap: envoyconf.add_route(
            bootstrap, name="tight", prefix="/v1/", host="127.0.0.1", port=stage.port,
            timeout="0s"))
    try:
        def metric(name: str, pipeline: str) -> float:
            return harness.metric_value(node.metrics(), name, pipeline=pipeline,
                                        stage="llm", format="openai")

        assert _stream(envoy.listen_port, "/v1/chat/completions") == TOKENS
        assert _stream(envoy.listen_port, "/v2/chat/completions") == TOKENS
        for pipeline in ("tight", "loose"):
            harness.wait_until(
                lambda p=pipeline: metric("sitsmesh_token_streams_total", p) == 1,
                5, f"the {pipeline} stream reported")
        assert metric("sitsmesh_token_stalls_total", "tight") == 1
        assert metric("sitsmesh_token_stalls_total", "loose") == 0
    finally:
        envoy.kill()
