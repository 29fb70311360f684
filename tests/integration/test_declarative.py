"""`sitsmesh apply / diff / get` against a real `sitsmesh serve`: one transaction per apply,
round trips, dry runs, label-scoped prune, and an applied tenant admitting a request."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml

from sitsmesh.dev import harness

pytestmark = pytest.mark.integration
Start = Callable[..., harness.Sitsmesh]
MANAGED = "sitsmesh.io/managed-by=team-a"

CONFIG = """\
apiVersion: sitsmesh.io/v1alpha1
kind: Tenant
metadata:
  name: team-a
  labels: {sitsmesh.io/managed-by: team-a}
spec:
  models: [bert]
  priority: 2
---
apiVersion: sitsmesh.io/v1alpha1
kind: Pipeline
metadata:
  name: checkout
  labels: {sitsmesh.io/managed-by: team-a}
spec:
  stages:
    - name: model
      match: {upstream_cluster: triton}
      sla_p99_ms: 250
---
apiVersion: sitsmesh.io/v1alpha1
kind: Thresholds
metadata:
  name: checkout
spec:
  policy: seed
  queue_fill_high: 0.8
---
apiVersion: sitsmesh.io/v1alpha1
kind: RateLimitConfig
metadata:
  name: team-a-limits
spec:
  descriptors:
    - key: tenant
      value: team-a
      rate_limit: {unit: second, requests_per_unit: 50}
"""

POLICY = """\
apiVersion: sitsmesh.io/v1alpha1
kind: ApiKeyPolicy
metadata: {name: team-a}
spec: {max_ttl_s: 3600}
"""

BUDGET = """\
apiVersion: sitsmesh.io/v1alpha1
kind: TokenBudget
metadata: {name: team-a}
spec:
  limits:
    - {tokens: 100000, per: minute}
    - {tokens: 2000000, per: day, each: model, models: [bert]}
  weights: {output: 3}
"""

BAD_PIPELINE = """\
---
apiVersion: sitsmesh.io/v1alpha1
kind: Pipeline
metadata: {name: broken}
spec:
  stages: [{name: model, match: {nowhere: x}}]
"""


def write(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def check(node: harness.Sitsmesh, key: str, model: str = "bert") -> int:
    from envoy.service.auth.v3 import (
        attribute_context_pb2,
        external_auth_pb2,
        external_auth_pb2_grpc,
    )

    ctx = attribute_context_pb2.AttributeContext
    request = external_auth_pb2.CheckRequest(attributes=ctx(request=ctx.Request(
        http=ctx.HttpRequest(method="POST", path=f"/v2/models/{model}/infer",
                             headers={"x-api-key": key}))))
    with grpc.insecure_channel(node.data_addr) as channel:
        reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=5)
    code: int = reply.status.code
    return code


def test_apply_then_get_round_trips_and_the_imperative_api_sees_it(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    node = start_sitsmesh()
    config = write(tmp_path, "config.yaml", CONFIG)
    assert ok(node.cli("apply", "-f", str(config))).splitlines() == [
        "tenant/team-a created", "pipeline/checkout created", "thresholds/checkout created",
        "ratelimitconfig/team-a-limits created"]

    # What the imperative RPCs read back is what was applied.
    tenant = json.loads(ok(node.cli("tenants", "get", "team-a", "-o", "json")))
    assert (tenant["models"], tenant["priority"]) == (["bert"], 2)
    assert "team-a-limits" in ok(node.cli("ratelimit", "get", "-o", "json"))
    thresholds = yaml.safe_load(ok(node.cli("thresholds", "get", "checkout", "-o", "yaml")))
    assert thresholds["thresholds"]["policy"] == "seed"
    # Audited as `thresholds set` audits: the credential, and whom the CLI acts for.
    history = ok(node.cli("thresholds", "history", "checkout", "-o", "json"))
    assert '"actor": "admin (on behalf of ' in history

    live = write(tmp_path, "live.yaml", ok(node.cli("get", "all", "-o", "yaml")))
    docs = list(yaml.safe_load_all(live.read_text()))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("Tenant", "team-a"), ("Pipeline", "checkout"), ("Thresholds", "checkout"),
        ("RateLimitConfig", "team-a-limits")]
    assert docs[0]["metadata"]["labels"] == {"sitsmesh.io/managed-by": "team-a"}
    # Round trip: what get printed applies back as unchanged, and so do the files.
    for source in (live, config):
        assert all(line.endswith(" unchanged") for line in
                   ok(node.cli("apply", "-f", str(source))).splitlines())
        assert node.cli("diff", "-f", str(source)).returncode == 0
    as_json = write(tmp_path, "live.json", ok(node.cli("get", "tenants", "-o", "json")))
    assert ok(node.cli("apply", "-f", str(as_json))) == "tenant/team-a unchanged\n"
    one = json.loads(ok(node.cli("get", "tenant", "team-a", "-o", "json")))
    assert one["spec"]["models"] == ["bert"]
    assert "team-a-limits" in ok(node.cli("get", "ratelimitconfigs"))


def test_bad_document_or_dry_run_writes_nothing(tmp_path: Path, start_sitsmesh: Start) -> None:
    node = start_sitsmesh()
    bad = write(tmp_path, "bad.yaml", CONFIG + BAD_PIPELINE)
    refused = node.cli("apply", "-f", str(bad))
    assert refused.returncode == 1
    assert "bad.yaml: document 4 (Pipeline/broken): pipeline broken: stages[0]: match must " \
           "have exactly one of upstream_cluster, route_name, header" in refused.stderr
    assert ok(node.cli("get", "all")) == "no objects\n"

    config = write(tmp_path, "config.yaml", CONFIG)
    dry = ok(node.cli("apply", "-f", str(config), "--dry-run")).splitlines()
    assert dry[0] == "tenant/team-a created (dry run)"
    assert ok(node.cli("get", "all")) == "no objects\n"
    diff = node.cli("diff", "-f", str(config))
    assert diff.returncode == 1, diff.stderr
    assert "+++ applied/Tenant/team-a\n" in diff.stdout
    assert "+  - bert\n" in diff.stdout

    ok(node.cli("apply", "-f", str(config)))
    changed = write(tmp_path, "changed.yaml", CONFIG.replace("priority: 2", "priority: 4"))
    diff = node.cli("diff", "-f", str(changed))
    assert diff.returncode == 1
    assert "-  priority: 2\n" in diff.stdout and "+  priority: 4\n" in diff.stdout
    reply = json.loads(ok(node.cli("apply", "-f", str(changed), "-o", "json")))
    assert [r["action"] for r in reply["results"]] == [
        "configured", *["unchanged"] * 3]
    assert (reply["applied"], reply["dry_run"]) == (True, False)
    assert json.loads(ok(node.cli("tenants", "get", "team-a", "-o", "json")))["priority"] == 4


def test_prune_deletes_only_labelled_objects_missing_from_the_files(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    node = start_sitsmesh()
    ok(node.cli("apply", "-f", str(write(tmp_path, "config.yaml", CONFIG))))
    extra = CONFIG.split("---\n", maxsplit=1)[0].replace("team-a\n  labels", "team-a2\n  labels")
    ok(node.cli("apply", "-f", str(write(tmp_path, "extra.yaml", extra))))
    ok(node.cli("tenants", "create", "by-hand", "--models", "*"))
    team_b = extra.replace("team-a2", "team-b").replace("managed-by: team-a", "managed-by: "
                                                          "team-b")
    ok(node.cli("apply", "-f", str(write(tmp_path, "team-b.yaml", team_b))))

    # The directory now holds only the tenant team-a: team-a2 is labelled and gone.
    folder = tmp_path / "team-a"
    folder.mkdir()
    write(folder, "tenants.yaml", CONFIG.split("---\n", maxsplit=1)[0])
    out = ok(node.cli("apply", "-f", str(folder), "--prune", "-l", MANAGED))
    assert out.splitlines() == ["tenant/team-a unchanged", "tenant/team-a2 pruned"]
    names = {d["metadata"]["name"] for d in
             yaml.safe_load_all(ok(node.cli("get", "tenants", "-o", "yaml")))}
    # Not the unlabelled one, not another team's, and no other kind (the pipeline stays).
    assert names == {"team-a", "by-hand", "team-b"}
    assert "checkout" in ok(node.cli("get", "pipelines"))
    refused = node.cli("apply", "-f", str(folder), "--prune")
    assert refused.returncode == 2 and "--prune needs -l" in refused.stderr


def test_applied_tenant_admits_a_request_and_a_change_takes_effect(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    from google.rpc import code_pb2

    node = start_sitsmesh()
    ok(node.cli("apply", "-f", str(write(tmp_path, "config.yaml", CONFIG))))
    key = json.loads(ok(node.cli("apikeys", "create", "--tenant", "team-a", "-o", "json")))
    assert check(node, key["key"]) == code_pb2.OK
    assert check(node, key["key"], model="llama") == code_pb2.PERMISSION_DENIED
    moved = CONFIG.replace("models: [bert]", "models: [llama]")
    ok(node.cli("apply", "-f", str(write(tmp_path, "moved.yaml", moved))))
    assert check(node, key["key"]) == code_pb2.PERMISSION_DENIED
    assert check(node, key["key"], model="llama") == code_pb2.OK

    # An ApiKeyPolicy governs the keys made after it: here, at most an hour each.
    ok(node.cli("apply", "-f", str(write(tmp_path, "policy.yaml", POLICY))))
    refused = node.cli("apikeys", "create", "--tenant", "team-a")
    assert refused.returncode == 1
    assert "tenant team-a: its ApiKeyPolicy lets keys live at most 3600 s" in refused.stderr
    ok(node.cli("apikeys", "create", "--tenant", "team-a", "--expires", "30m"))
    assert yaml.safe_load(ok(node.cli("get", "apikeypolicy", "team-a", "-o", "yaml")))[
        "spec"] == {"max_ttl_s": 3600, "max_active_keys": 0}


def test_workers_follow_an_apply_and_refuse_what_needs_one_process(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    from google.rpc import code_pb2

    node = start_sitsmesh("--workers", "2")
    tenant = CONFIG.split("---\n", maxsplit=1)[0]
    ok(node.cli("apply", "-f", str(write(tmp_path, "tenant.yaml", tenant))))
    key = json.loads(ok(node.cli("apikeys", "create", "--tenant", "team-a", "-o", "json")))

    def every_connection(model: str, code: int) -> bool:
        # A fresh channel per call: the kernel spreads them over both workers.
        return all(check(node, key["key"], model) == code for _ in range(12))

    harness.wait_until(lambda: every_connection("bert", code_pb2.OK), 10,
                       "both workers to admit the applied tenant")
    moved = tenant.replace("models: [bert]", "models: [llama]")
    ok(node.cli("apply", "-f", str(write(tmp_path, "moved.yaml", moved))))
    harness.wait_until(lambda: every_connection("bert", code_pb2.PERMISSION_DENIED), 10,
                       "both workers to follow the change")

    refused = node.cli("apply", "-f", str(write(tmp_path, "all.yaml", CONFIG)))
    assert refused.returncode == 1
    assert "pipeline checkout: backpressure and latency chains needs --workers 1" in \
        refused.stderr
    assert json.loads(ok(node.cli("tenants", "get", "team-a", "-o", "json")))["models"] == [
        "llama"]


def test_a_token_budget_applies_reads_back_and_a_bad_one_changes_nothing(
        tmp_path: Path, start_sitsmesh: Start) -> None:
    node = start_sitsmesh()
    budget = write(tmp_path, "budget.yaml", BUDGET)
    assert ok(node.cli("apply", "-f", str(budget))) == "tokenbudget/team-a created\n"
    spec = {"limits": [{"tokens": 100000, "per": "minute", "each": "tenant", "models": ["*"]},
                       {"tokens": 2000000, "per": "day", "each": "model", "models": ["bert"]}],
            "weights": {"input": 1.0, "output": 3.0, "cached_input": 0.0},
            "default_max_tokens": 4096, "chars_per_token": 4.0}
    got = yaml.safe_load(ok(node.cli("get", "tokenbudget", "team-a", "-o", "yaml")))
    assert (got["kind"], got["spec"]) == ("TokenBudget", spec)
    live = write(tmp_path, "live.yaml", ok(node.cli("get", "tokenbudgets", "-o", "yaml")))
    assert ok(node.cli("apply", "-f", str(live))) == "tokenbudget/team-a unchanged\n"

    bad = write(tmp_path, "bad.yaml", BUDGET.replace("per: day", "per: week")
                .replace("tokens: 100000", "tokens: 5"))
    refused = node.cli("apply", "-f", str(bad))
    assert refused.returncode == 1
    assert "bad.yaml: document 0 (TokenBudget/team-a): token budget team-a: limits[1]: per " \
           "must be one of minute, hour, day, got 'week'" in refused.stderr
    got = yaml.safe_load(ok(node.cli("get", "tokenbudget", "team-a", "-o", "yaml")))
    assert got["spec"] == spec

    # The usage view reads the serving ledger: a budget of a tenant that does not exist
    # (yet) has nothing to show, and says so.
    usage = node.cli("tenants", "usage", "team-a")
    assert usage.returncode == 1
    assert "GetTokenUsage" in usage.stderr
    assert "NOT_FOUND: tenant team-a does not exist" in usage.stderr
