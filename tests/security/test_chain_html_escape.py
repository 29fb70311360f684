"""Attack: a request id (the client's x-request-id, kept by an Envoy that preserves
external ids) carrying markup, shown in `chain show --output html`. It must render as
text in a real browser and never run.

Pipeline and stage names cannot carry markup (pipeline_from refuses them), and trace ids
are 32 hex digits or nothing (a traceparent with markup is ignored), so the request id is
the one free-form string from the data plane the page shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sitsmesh.dev import harness
from tests import browser
from tests.integration.test_chain_report import traffic

pytestmark = pytest.mark.integration

EVIL = "<script>document.title='pwned'</script>"
TITLE = "sitsmesh latency chain: demo"
SLOW = {
    EVIL: (200, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    "img": (150, f"00-{'1' * 32}-00f067aa0ba902b7-01\"><img src=x onerror=alert(1)>"),
}


def test_the_detector_sees_a_script_that_runs(tmp_path: Path) -> None:
    """Without escaping, this very string would run in the page and change its title."""
    page = tmp_path / "raw.html"
    page.write_text(f"<!DOCTYPE html><html><head><title>{TITLE}</title></head>"
                    f"<body><span class='request-id'>{EVIL}</span></body></html>")
    dom = browser.Dom.parse(browser.dump_dom(page, tmp_path))
    assert dom.title == "pwned" and "script" in dom.tags


@pytest.fixture
def sitsmesh(tmp_path: Path) -> Iterator[harness.Sitsmesh]:
    node = harness.start_sitsmesh(tmp_path)
    yield node
    node.kill()


def test_a_request_id_with_markup_renders_as_text(tmp_path: Path,
                                                  sitsmesh: harness.Sitsmesh) -> None:
    doc = traffic(tmp_path, sitsmesh, SLOW)
    assert [c["request_id"] for c in doc["slowest"][:2]] == [EVIL, "img"]
    assert doc["slowest"][1]["trace_id"] == ""  # the traceparent with markup was ignored
    page = tmp_path / "chain.html"
    written = sitsmesh.cli("chain", "show", "demo", "-o", "html", "--out", str(page))
    assert written.returncode == 0, written.stderr
    dom = browser.Dom.parse(browser.dump_dom(page, tmp_path))
    assert dom.title == TITLE  # the script did not run
    assert "script" not in dom.tags and "img" not in dom.tags
    assert dom.by_class["request-id"][0] == EVIL  # shown, as text
    assert browser.screenshot(page, tmp_path).stat().st_size > 20_000
