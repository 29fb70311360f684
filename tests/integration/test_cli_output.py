"""The CLI's output against a real `sitsmesh serve`: one table layout sized by its content,
and -o json/yaml of the same documents, on the commands the issue named."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

PIPELINE = """name: demo
stages:
  - name: model
    match: {upstream_cluster: triton}
    sla_p99_ms: 250
"""
LONG_NAME = "ci-deploy-key-for-the-inference-gateway-of-team-recommenders"


def test_tables_fit_long_names_and_yaml_matches_json(
        tmp_path: Path, start_sitsmesh: Callable[..., harness.Sitsmesh]) -> None:
    node = start_sitsmesh()
    assert len(LONG_NAME) == 60
    made = node.cli("tenants", "create", "acme-recommenders", "--models", "rec-*,bert",
                    "--priority", "3", "--label", "team=rec")
    assert made.returncode == 0, made.stderr
    key = node.cli("apikeys", "create", "--tenant", "acme-recommenders", "--name", LONG_NAME,
                   "-o", "yaml")
    assert key.returncode == 0, key.stderr
    assert yaml.safe_load(key.stdout)["key"].startswith("smk_")

    listed = node.cli("tenants", "list")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["NAME", "MODELS", "PRIORITY", "MAX_PRIORITY", "MAX_CONCURRENCY",
                              "LABELS"]
    assert row.split() == ["acme-recommenders", "rec-*,bert", "3", "3", "0", "team=rec"]
    assert row.index("rec-*") == header.index("MODELS")
    assert yaml.safe_load(node.cli("tenants", "list", "-o", "yaml").stdout) == json.loads(
        node.cli("tenants", "list", "-o", "json").stdout)

    keys = node.cli("apikeys", "list")
    assert keys.returncode == 0, keys.stderr
    header, row = keys.stdout.splitlines()
    # The old fixed widths pushed a long tenant's columns out from under their headers.
    for column, value in (("TENANT", "acme-recommenders"), ("STATE", "active"),
                          ("EXPIRES", "never"), ("NAME", LONG_NAME)):
        assert row.index(value) == header.index(column), (column, keys.stdout)
    assert row.endswith(LONG_NAME)
    as_yaml = yaml.safe_load(node.cli("apikeys", "list", "-o", "yaml").stdout)
    assert as_yaml == json.loads(node.cli("apikeys", "list", "-o", "json").stdout)
    assert [k["name"] for k in as_yaml["keys"]] == [LONG_NAME]

    (tmp_path / "demo.yaml").write_text(PIPELINE)
    assert node.cli("pipelines", "apply", str(tmp_path / "demo.yaml")).returncode == 0
    body = tmp_path / "t.yaml"
    body.write_text("policy: seed\nqueue_fill_high: 0.8\n")
    done = node.cli("thresholds", "set", "demo", str(body), "-o", "yaml")
    assert done.returncode == 0, done.stderr
    doc = yaml.safe_load(done.stdout)
    assert (doc["pipeline"], doc["dry_run"]) == ("demo", False)
    assert doc["thresholds"]["policy"] == "seed"
    assert doc["thresholds"]["queue_fill_high"] == 0.8
    dry = node.cli("thresholds", "set", "demo", str(body), "--dry-run", "-o", "json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {**doc, "dry_run": True}


def test_health_and_admin_commands_find_sitsmesh_through_the_environment(
        start_sitsmesh: Callable[..., harness.Sitsmesh]) -> None:
    node = start_sitsmesh()
    # Only the variable: before, health ignored it and checked 127.0.0.1:50051.
    health = harness.run_cli("health", env={"SITSMESH_DATA_ADDR": node.data_addr})
    assert (health.returncode, health.stdout) == (0, "SERVING\n"), health.stderr
    as_yaml = harness.run_cli("health", "-o", "yaml", env={"SITSMESH_DATA_ADDR": node.data_addr})
    assert yaml.safe_load(as_yaml.stdout) == {"addr": node.data_addr, "service": "",
                                              "status": "SERVING"}

    env = {"SITSMESH_ADMIN_ADDR": node.admin_addr, "SITSMESH_STATE_DIR": str(node.state_dir),
           "SITSMESH_OUTPUT": "yaml", "SITSMESH_TIMEOUT": "4"}
    status = harness.run_cli("status", env=env)
    assert status.returncode == 0, status.stderr
    assert yaml.safe_load(status.stdout)["data_addr"] == node.data_addr
    # A flag beats its variable.
    as_json = harness.run_cli("status", "-o", "json", env=env)
    assert json.loads(as_json.stdout)["admin_addr"] == node.admin_addr
