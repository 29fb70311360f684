"""Per-team access on ConfigService, through a real `sitsmesh serve` with an
--admin-credentials file: a team operator applies its own objects and nothing of another
team's (one foreign document refuses the whole apply, dry run included), cannot prune
outside its scope, and cannot change global rate-limit config; a viewer reads only."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from sitsmesh.admin.v1 import config_pb2, config_pb2_grpc
from sitsmesh.dev import harness
from tests.security import credfile

pytestmark = pytest.mark.integration

ROOT, TEAM_A, VIEWER = "r" * 40, "a" * 40, "v" * 40
MANAGED = "sitsmesh.io/managed-by=shared"


def tenant(name: str, owner: str = "shared") -> str:
    return (f"apiVersion: sitsmesh.io/v1alpha1\nkind: Tenant\nmetadata: {{name: {name}, "
            f"labels: {{sitsmesh.io/managed-by: {owner}}}}}\nspec: {{models: [m]}}\n")


PIPELINE_A = ("apiVersion: sitsmesh.io/v1alpha1\nkind: Thresholds\nmetadata: {name: pipe-a}\n"
              "spec: {policy: seed}\n")
LIMITS = ("apiVersion: sitsmesh.io/v1alpha1\nkind: RateLimitConfig\nmetadata: {name: d}\n"
          "spec: {descriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]}\n")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Sitsmesh]:
    with credfile.serving(tmp_path_factory.mktemp("decl-rbac"),
                          credfile.entry("root", "admin", ROOT), credfile.entry(
                              "team-a", "operator", TEAM_A,
                              {"tenants": ["team-a"], "pipelines": ["pipe-a"],
                               "models": ["m"]}),
                          credfile.entry("dashboards", "viewer", VIEWER)) as started:
        yield started


def apply(node: harness.Sitsmesh, token: str, text: str, *, dry_run: bool = False,
          prune: bool = False, prune_selector: str = ""
          ) -> tuple[grpc.StatusCode, str, config_pb2.ApplyResponse | None]:
    request = config_pb2.ApplyRequest(
        files=[config_pb2.ApplyFile(name="f.yaml", documents=text)], dry_run=dry_run,
        prune=prune, prune_selector=prune_selector)
    with grpc.insecure_channel(node.admin_addr) as channel:
        try:
            reply = config_pb2_grpc.ConfigServiceStub(channel).Apply(
                request, metadata=(("authorization", f"Bearer {token}"),), timeout=5)
        except grpc.RpcError as err:
            return err.code(), err.details() or "", None
    return grpc.StatusCode.OK, "", reply


def names(node: harness.Sitsmesh, token: str) -> set[str]:
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = config_pb2_grpc.ConfigServiceStub(channel).Get(
            config_pb2.GetRequest(kind="Tenant"),
            metadata=(("authorization", f"Bearer {token}"),), timeout=5)
    return {d.name for d in reply.documents}


def test_an_operator_applies_its_own_and_nothing_of_another_team_s(
        node: harness.Sitsmesh) -> None:
    assert apply(node, TEAM_A, tenant("team-a", "team-a") + "---\n" + PIPELINE_A)[0] == \
        grpc.StatusCode.OK
    for dry_run in (True, False):
        code, details, _ = apply(node, TEAM_A, tenant("team-a", "team-a") + "---\n"
                                 + tenant("team-b", "team-a"),
                                 dry_run=dry_run)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "Tenant/team-b: credential 'team-a' (operator) may not write tenant " \
               "'team-b': not in its tenants scope" in details
    assert names(node, ROOT) == {"team-a"}
    code, details, _ = apply(node, TEAM_A, LIMITS)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "may not write global settings: only admins may" in details


def budget(name: str, models: str = "[m]") -> str:
    return (f"apiVersion: sitsmesh.io/v1alpha1\nkind: TokenBudget\nmetadata: {{name: {name}}}"
            f"\nspec: {{limits: [{{tokens: 1000, per: minute, models: {models}}}]}}\n")


def test_an_operator_budgets_its_own_tenant_within_its_models_only(
        node: harness.Sitsmesh) -> None:
    assert apply(node, TEAM_A, budget("team-a"))[0] == grpc.StatusCode.OK
    code, details, _ = apply(node, TEAM_A, budget("team-b"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "TokenBudget/team-b: credential 'team-a' (operator) may not write tenant " \
           "'team-b': not in its tenants scope" in details
    code, details, _ = apply(node, TEAM_A, budget("team-a", "[m, other-*]"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "TokenBudget/team-a: credential 'team-a' (operator) may not write TokenBudget " \
           "'team-a': limits[0].models[1] 'other-*' is not within its models scope" in details
    with grpc.insecure_channel(node.admin_addr) as channel:
        reply = config_pb2_grpc.ConfigServiceStub(channel).Get(
            config_pb2.GetRequest(kind="TokenBudget"),
            metadata=(("authorization", f"Bearer {ROOT}"),), timeout=5)
    assert [d.name for d in reply.documents] == ["team-a"]
    assert '"models": ["m"]' in reply.documents[0].json


def test_an_operator_cannot_prune_outside_its_scope(node: harness.Sitsmesh) -> None:
    assert apply(node, ROOT, tenant("team-a") + "---\n" + tenant("team-c"))[0] == \
        grpc.StatusCode.OK
    # team-c carries the label too, but is not team-a's to delete.
    code, details, _ = apply(node, TEAM_A, tenant("team-a"), prune=True,
                             prune_selector=MANAGED)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "Tenant/team-c: credential 'team-a' (operator) may not write tenant 'team-c'" in \
        details
    assert "team-c" in names(node, ROOT)
    code, _, reply = apply(node, ROOT, tenant("team-a"), prune=True, prune_selector=MANAGED)
    assert code == grpc.StatusCode.OK and reply is not None
    assert [(r.name, r.action) for r in reply.results] == [
        ("team-a", config_pb2.APPLY_ACTION_UNCHANGED),
        ("team-c", config_pb2.APPLY_ACTION_PRUNED)]


def test_a_viewer_reads_but_applies_nothing(node: harness.Sitsmesh) -> None:
    assert apply(node, ROOT, tenant("team-r"))[0] == grpc.StatusCode.OK
    assert "team-r" in names(node, VIEWER)
    code, details, _ = apply(node, VIEWER, tenant("team-v"), dry_run=True)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "viewers only read" in details
    code, _, _ = apply(node, "x" * 40, tenant("team-v"))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "team-v" not in names(node, ROOT)
