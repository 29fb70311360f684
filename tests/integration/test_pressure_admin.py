"""Thresholds and pressure through `sitsmesh serve`'s admin API and the CLI: set, get,
audit, bad input that changes nothing, the live stream, the offline simulator, and a
Triton metrics endpoint that is down (its stage is stale: fail safe)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

PIPELINE = """name: demo
models: ["lazy"]
stages:
  - name: model
    match: {upstream_cluster: triton}
    sla_p99_ms: 250
    triton_model: lazy
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def node(tmp_path: Path) -> Iterator[harness.Sitsmesh]:
    # Nothing listens on the metrics URL: the Triton behind the stage is unobservable.
    node = harness.start_sitsmesh(tmp_path, "--triton-url", f"127.0.0.1:{_closed_port()}",
                                  "--triton-metrics-url",
                                  f"http://127.0.0.1:{_closed_port()}/metrics")
    try:
        (tmp_path / "demo.yaml").write_text(PIPELINE)
        done = node.cli("pipelines", "apply", str(tmp_path / "demo.yaml"))
        assert done.returncode == 0, done.stderr
        yield node
    finally:
        node.kill()


def test_thresholds_set_get_audit_and_bad_input_changes_nothing(
        tmp_path: Path, node: harness.Sitsmesh) -> None:
    got = node.cli("thresholds", "get", "demo", "--output", "json")
    assert got.returncode == 0, got.stderr
    doc = json.loads(got.stdout)
    assert doc["is_default"] and doc["thresholds"]["policy"] == "sitsmesh"

    good = tmp_path / "t.yaml"
    good.write_text("policy: seed\nqueue_fill_high: 0.8\nstages:\n  model: {parallelism: 2}\n")
    done = node.cli("thresholds", "set", "demo", str(good),
                    env={"USER": "sre-alice", "LOGNAME": "sre-alice"})
    assert done.returncode == 0, done.stderr
    after = yaml.safe_load(node.cli("thresholds", "get", "demo").stdout)
    assert after["policy"] == "seed" and after["queue_fill_high"] == 0.8
    assert after["stages"] == {"model": {"parallelism": 2}}

    bad = tmp_path / "bad.yaml"
    for body, message in [
        ("policy: turbo\n", "bad.yaml: policy must be one of sitsmesh, seed, off, got 'turbo'"),
        ("queue_fill_low: 0.9\n", "queue_fill_low (0.9) must be below queue_fill_high (0.7)"),
        ("stages: [1]\n", "stages must be a mapping"),
        ("policy: [\n", "bad.yaml: invalid YAML"),
    ]:
        bad.write_text(body)
        refused = node.cli("thresholds", "set", "demo", str(bad))
        assert refused.returncode == 1
        assert "INVALID_ARGUMENT" in refused.stderr and message in refused.stderr, (
            refused.stderr)
    assert yaml.safe_load(node.cli("thresholds", "get", "demo").stdout) == after

    dry = node.cli("thresholds", "set", "demo", str(good), "--dry-run")
    assert dry.returncode == 0 and "dry run" in dry.stderr
    history = json.loads(node.cli("thresholds", "history", "demo", "--output", "json").stdout)
    assert len(history) == 1  # neither the refused nor the dry-run sets were recorded
    # The credential the token proved; the CLI's user@host is only a claim beside it.
    assert history[0]["actor"].startswith("admin (on behalf of sre-alice@")
    assert history[0]["peer"].startswith("ipv4:127.0.0.1:")
    assert history[0]["before"] is None and history[0]["after"]["policy"] == "seed"


def test_watch_shows_the_unobservable_stage_as_stale_and_shedding(
        tmp_path: Path, node: harness.Sitsmesh) -> None:
    watched = node.cli("pressure", "watch", "demo", "--count", "2", "--interval-ms", "100",
                       "--output", "json")
    assert watched.returncode == 0, watched.stderr
    snapshots = [json.loads(line) for line in watched.stdout.splitlines()]
    assert len(snapshots) == 2
    [pipeline] = snapshots[-1]["pipelines"]
    assert pipeline["pipeline"] == "demo"
    assert pipeline["level"] == "stale" and pipeline["stages"][0]["stale"]
    # Scraped but nothing came back: the source says so, with no age to give.
    assert pipeline["stages"][0]["signals"] == [
        {"source": "triton_metrics", "age_s": -1.0, "stale": True}]
    assert pipeline["concurrency"] == 1  # fail safe: the minimum, not unbounded
    table = node.cli("pressure", "watch", "--count", "1")
    assert table.returncode == 0
    assert table.stdout.splitlines()[0].split()[:3] == ["PIPELINE", "STAGE", "LEVEL"]
    assert "triton none STALE" in table.stdout
    missing = node.cli("pressure", "watch", "nope", "--count", "1")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_simulate_compares_policies_offline(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "t.yaml").write_text("stages:\n  model: {queue_capacity: 32}\n")
    (tmp_path / "load.yaml").write_text(
        "duration_s: 16\npriorities: {0: 0.7, 9: 0.3}\nservice_ms: {model: 20}\n"
        "steps:\n  - {at_s: 0, rps: 25}\n  - {at_s: 4, rps: 100}\n  - {at_s: 12, rps: 25}\n")
    done = harness.run_cli("simulate", "--pipeline", str(tmp_path / "p.yaml"), "--thresholds",
                           str(tmp_path / "t.yaml"), "--load", str(tmp_path / "load.yaml"),
                           "--compare", "--output", "json")
    assert done.returncode == 0, done.stderr
    runs = json.loads(done.stdout)
    assert set(runs) == {"sitsmesh", "seed", "off"}
    assert runs["sitsmesh"]["goodput_rps"] > runs["seed"]["goodput_rps"]
    assert runs["sitsmesh"]["success_by_priority"]["9"] >= 0.999
    assert len(runs["sitsmesh"]["seconds"]) == 16
    (tmp_path / "bad.yaml").write_text("duration_s: 5\nsteps: []\n")
    bad = harness.run_cli("simulate", "--pipeline", str(tmp_path / "p.yaml"), "--load",
                          str(tmp_path / "bad.yaml"))
    assert bad.returncode == 2
    assert "bad.yaml: steps must be a list of {at_s, rps}" in bad.stderr


def test_with_several_workers_the_controller_says_where_it_runs(tmp_path: Path) -> None:
    node = harness.start_sitsmesh(tmp_path, "--workers", "2")
    try:
        (tmp_path / "demo.yaml").write_text(PIPELINE)
        applied = node.cli("pipelines", "apply", str(tmp_path / "demo.yaml"))
        assert applied.returncode == 1
        assert "FAILED_PRECONDITION" in applied.stderr and "--workers 1" in applied.stderr
        watched = node.cli("pressure", "watch", "--count", "1")
        assert watched.returncode == 1
        assert "FAILED_PRECONDITION" in watched.stderr and "--workers 1" in watched.stderr
    finally:
        node.kill()
