"""`chain show`'s slowest section, its json and its html page, from a LatencyChain reply
(the page as a browser shows it is checked in tests/integration/test_chain_report.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sitsmesh.admin.v1 import admin_pb2
from sitsmesh.cli import chainhtml, main, pipelines
from sitsmesh.cli.common import EXIT_USAGE

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
EVIL = "<script>document.title='pwned'</script>"


def _reply(request_id: str = "rid-1", stage: str = "model") -> admin_pb2.LatencyChain:
    reply = admin_pb2.LatencyChain(pipeline="demo", window="1m", chains=3, e2e_p50_ms=50,
                                   e2e_p99_ms=120, bottleneck=stage)
    for name in ("pre", stage):
        reply.stages.add(name=name, p50_ms=10, p90_ms=20, p99_ms=30, attributed_ms=40,
                         share_of_e2e_p99=0.5)
        reply.histograms.add(name=name, buckets=[
            admin_pb2.HistogramBucket(le_ms=0.98, count=1),
            admin_pb2.HistogramBucket(le_ms=10.24, count=1),
            admin_pb2.HistogramBucket(le_ms=101.7, count=1)])
    for i, rid in enumerate((request_id, "rid-2")):
        reply.slowest.add(request_id=rid, trace_id=TRACE if i == 0 else "",
                          e2e_ms=120 - i, stages=[
                              admin_pb2.SlowChainStage(name="pre", offset_ms=0, own_ms=20,
                                                       total_ms=120),
                              admin_pb2.SlowChainStage(name=stage, offset_ms=5, own_ms=100,
                                                       total_ms=100)])
    return reply


def _serve(monkeypatch: pytest.MonkeyPatch, reply: admin_pb2.LatencyChain) -> None:
    def call(args: Any, method: str, request: Any) -> Any:
        assert method == "GetLatencyChain" and request.pipeline == "demo"
        return admin_pb2.GetLatencyChainResponse(chain=reply)
    monkeypatch.setattr(pipelines, "call_admin", call)


def test_the_table_names_the_slowest_requests_and_their_traces(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _serve(monkeypatch, _reply(request_id="rid-1\x1b[2J"))
    assert main(["chain", "show", "demo"]) == 0
    out = capsys.readouterr().out
    assert "SLOWEST (of 2)" in out
    rows = out.split("SLOWEST (of", 1)[1].splitlines()[1:]
    assert rows[0].split() == ["120.0", TRACE, "rid-1\\x1b[2J"]  # no raw escape reaches the tty
    assert rows[1].split() == ["119.0", "-", "rid-2"]


def test_json_has_the_slowest_chains_and_the_histograms(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _serve(monkeypatch, _reply())
    assert main(["chain", "show", "demo", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["slowest"][0] == {
        "request_id": "rid-1", "trace_id": TRACE, "e2e_ms": 120.0, "failed": False,
        "stages": [{"name": "pre", "offset_ms": 0.0, "own_ms": 20.0, "total_ms": 120.0},
                   {"name": "model", "offset_ms": 5.0, "own_ms": 100.0, "total_ms": 100.0}]}
    assert doc["histograms"][1] == {"name": "model", "buckets": [
        {"le_ms": 0.98, "count": 1}, {"le_ms": 10.24, "count": 1}, {"le_ms": 101.7, "count": 1}]}


def test_html_goes_to_stdout_or_to_the_file_out_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _serve(monkeypatch, _reply())
    assert main(["chain", "show", "demo", "-o", "html"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!DOCTYPE html>") and TRACE in page
    out = tmp_path / "chain.html"
    assert main(["chain", "show", "demo", "--output", "html", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_text(encoding="utf-8") == page
    code = main(["chain", "show", "demo", "-o", "html", "--out", str(tmp_path / "no" / "x")])
    assert code == 1 and "cannot write" in capsys.readouterr().err


def test_out_without_html_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(pipelines, "call_admin", lambda *a: pytest.fail("no rpc"))
    assert main(["chain", "show", "demo", "--out", "x.html"]) == EXIT_USAGE
    assert "--out goes with --output html" in capsys.readouterr().err


def test_the_page_is_self_contained_and_escapes_every_server_string() -> None:
    reply = _reply(request_id=EVIL, stage=EVIL)
    reply.pipeline = EVIL
    reply.slowest[1].trace_id = '"><img src=x onerror=alert(1)>'
    page = chainhtml.render(json.loads(json.dumps(_doc(reply))))
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "&lt;script&gt;document.title=&#x27;pwned&#x27;&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    # Nothing to fetch: no URL, no external stylesheet, font or image.
    assert not re.search(r"https?:|//[a-z]|@import|url\(|<link|<iframe|<object", page, re.I)
    assert page.count('class="chain waterfall-row"') == 2
    assert page.count("<svg") == 1 + 2 + 2  # time axis, a waterfall row each, a histogram each


def _doc(reply: admin_pb2.LatencyChain) -> dict[str, Any]:
    captured: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        wrapped = admin_pb2.GetLatencyChainResponse(chain=reply)
        patch.setattr(pipelines, "call_admin", lambda *a: wrapped)
        patch.setattr(pipelines, "render_html", lambda d: captured.update(d) or "")
        assert main(["chain", "show", "demo", "-o", "html", "--out", "/dev/null"]) == 0
    return captured


def test_histogram_bins_are_powers_of_two_with_gaps_filled() -> None:
    bins = chainhtml._bins([{"le_ms": 0.98, "count": 2}, {"le_ms": 1.02, "count": 1},
                            {"le_ms": 2.0, "count": 1}, {"le_ms": 10.24, "count": 4}])
    assert [(round(le, 2), n) for le, n in bins] == [(1.28, 3), (2.56, 1), (5.12, 0),
                                                    (10.24, 4)]
    wide = chainhtml._bins([{"le_ms": 0.011, "count": 1}, {"le_ms": 3_600_000, "count": 1}])
    assert len(wide) == chainhtml.MAX_BINS and sum(n for _, n in wide) == 2
    assert chainhtml._bins([]) == []


def _streaming_reply() -> admin_pb2.LatencyChain:
    reply = _reply(stage="llm")
    reply.token_chains, reply.ttft_owner = 3, "pre"
    reply.ttft_p50_ms, reply.ttft_p99_ms, reply.itl_p50_ms, reply.itl_p99_ms = 80, 90, 20, 30
    for stage in reply.stages:
        stage.ttft_attributed_ms, stage.ttft_share = 60, 0.75
    llm = reply.stages[1]
    llm.token_streams, llm.output_tokens, llm.stalls, llm.stall_max_ms = 3, 30, 1, 2000
    llm.ttft_p50_ms = 20
    slow = reply.slowest[0]
    slow.ttft_ms, slow.ttft_owner = 80, "pre"
    slow.stages[1].ttft_part_ms = 20
    slow.stages[1].stream.CopyFrom(admin_pb2.StageStream(
        ttft_ms=20, itl_p50_ms=5, output_tokens=10, tokens_per_s=200, stall_count=1,
        end="complete", stalls=[admin_pb2.TokenStall(after_ms=40, length_ms=2000)]))
    return reply


def test_a_streaming_pipelines_ttft_owner_and_stalls_in_table_json_and_html(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _serve(monkeypatch, _streaming_reply())
    assert main(["chain", "show", "demo"]) == 0
    out = capsys.readouterr().out
    assert "TTFT owner in the slowest 1 %: pre (60.0 ms, 75%)" in out
    rows = out.split("SLOWEST (of", 1)[1].splitlines()
    assert "TTFT ms" in rows[0] and "STALLS" in rows[0]
    assert "80.0" in rows[1] and "llm 2000 ms @+40 ms" in rows[1]
    assert main(["chain", "show", "demo", "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == {"ttft_p50_ms": 80.0, "ttft_p99_ms": 90.0, "itl_p50_ms": 20.0,
                             "itl_p99_ms": 30.0, "chains": 3, "ttft_owner": "pre",
                             "reports_dropped": 0}
    llm = doc["slowest"][0]["stages"][1]
    assert llm["ttft_part_ms"] == 20.0
    assert llm["stream"]["stalls"] == [{"after_ms": 40.0, "length_ms": 2000.0}]
    assert doc["stages"][1]["tokens"]["stall_max_ms"] == 2000.0
    page = chainhtml.render(doc)
    assert '<strong id="ttft-owner">pre</strong>' in page
    assert 'class="first-token"' in page and "stall of 2000.0 ms after 40.0 ms" in page
    assert "<th>longest stall ms</th>" in page
