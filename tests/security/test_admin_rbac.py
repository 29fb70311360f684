"""Per-team access to the admin API (issue 18, item 2), through a real `sitsmesh serve`
with an --admin-credentials file: a team's operator token cannot touch another team's
tenant, keys, pipeline or model; a viewer writes nothing; a wrong token is refused; the
audit names the credential; an mTLS identity maps to a role; a bad file is refused."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sitsmesh.access.credentials import hash_token
from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from sitsmesh.transport.adminaccess import RULES
from tests.security import tlsnode
from tests.security.pki import Ca

pytestmark = pytest.mark.integration

ROOT, TEAM_A, VIEWER, LATE = ("r" * 40, "a" * 40, "v" * 40, "l" * 40)
SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"]
PIPELINE = ("name: {}\nmodels: [m]\nstages:\n  - name: model\n"
            "    match: {{upstream_cluster: triton}}\n    sla_p99_ms: 250\n")


def _credentials(*extra: dict[str, Any]) -> str:
    entries = [
        {"name": "root", "role": "admin", "token_hash": hash_token(ROOT)},
        {"name": "team-a", "role": "operator", "token_hash": hash_token(TEAM_A),
         "scopes": {"tenants": ["team-a"], "pipelines": ["pipe-a"], "models": ["model-a"]}},
        {"name": "dashboards", "role": "viewer", "token_hash": hash_token(VIEWER)},
        {"name": "ci-a", "role": "operator", "mtls_identity": "spiffe://test/team-a-ci",
         "scopes": {"tenants": ["team-a"]}},
        *extra,
    ]
    return json.dumps({"credentials": entries})  # JSON is YAML


def _call(stub: admin_pb2_grpc.AdminServiceStub, method: str, request: Any, token: str = "",
          **kw: Any) -> Any:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    result = getattr(stub, method)(request, metadata=(*metadata, *kw.pop("metadata", ())),
                                   timeout=5, **kw)
    return list(result) if SERVICE.methods_by_name[method].server_streaming else result


def _code(stub: admin_pb2_grpc.AdminServiceStub, method: str, request: Any,
          token: str = "", **kw: Any) -> tuple[grpc.StatusCode, str]:
    try:
        _call(stub, method, request, token, **kw)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Sitsmesh]:
    tmp = tmp_path_factory.mktemp("rbac")
    creds = tmp / "credentials.yaml"
    creds.write_text(_credentials())
    started = harness.start_sitsmesh(tmp, "--admin-credentials", str(creds))
    try:
        yield started
    finally:
        started.kill()


@pytest.fixture(scope="module")
def stub(node: harness.Sitsmesh) -> Iterator[admin_pb2_grpc.AdminServiceStub]:
    with grpc.insecure_channel(node.admin_addr) as channel:
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        for team in ("team-a", "team-b"):
            _call(admin, "CreateTenant", admin_pb2.CreateTenantRequest(
                tenant=admin_pb2.Tenant(name=team, models=["m"])), ROOT)
        for pipe in ("pipe-a", "pipe-b"):
            _call(admin, "ApplyPipeline", admin_pb2.ApplyPipelineRequest(
                yaml=PIPELINE.format(pipe)), ROOT)
        yield admin


def test_a_team_token_cannot_touch_another_teams_tenant_keys_pipeline_or_model(
        stub: admin_pb2_grpc.AdminServiceStub) -> None:
    b_key = _call(stub, "CreateApiKey", admin_pb2.CreateApiKeyRequest(tenant="team-b"), ROOT)
    attacks = [
        ("UpdateTenant", admin_pb2.UpdateTenantRequest(
            tenant=admin_pb2.Tenant(name="team-b", models=["m"], priority=9))),
        ("DeleteTenant", admin_pb2.DeleteTenantRequest(name="team-b")),
        ("CreateTenant", admin_pb2.CreateTenantRequest(tenant=admin_pb2.Tenant(name="team-c"))),
        ("CreateApiKey", admin_pb2.CreateApiKeyRequest(tenant="team-b")),
        ("RevokeApiKey", admin_pb2.RevokeApiKeyRequest(id=b_key.key.id)),
        ("SwapModel", admin_pb2.SwapModelRequest(model="model-b", target_version=0)),
        ("ProfileModel", admin_pb2.ProfileModelRequest(model="model-b")),
        ("TuneModel", admin_pb2.TuneModelRequest(model="model-b")),
        ("TuneModel", admin_pb2.TuneModelRequest(model="model-b", dry_run=True)),
        ("SetAutoTuning", admin_pb2.SetAutoTuningRequest(
            auto_tuning=admin_pb2.AutoTuning(pipeline="pipe-b", enabled=True))),
        ("SetThresholds", admin_pb2.SetThresholdsRequest(pipeline="pipe-b", yaml="")),
        ("ApplyPipeline", admin_pb2.ApplyPipelineRequest(yaml=PIPELINE.format("pipe-b"))),
        ("DeletePipeline", admin_pb2.DeletePipelineRequest(name="pipe-b")),
        ("ApplyRateLimitConfig", admin_pb2.ApplyRateLimitConfigRequest(files=[
            admin_pb2.RateLimitConfigFile(name="x", yaml="domain: d\n")])),
    ]
    for method, request in attacks:
        code, details = _code(stub, method, request, TEAM_A)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
        assert details.startswith(f"{method}: credential 'team-a' (operator) may not write "), \
            details
    assert _code(stub, "UpdateTenant", attacks[0][1], TEAM_A)[1] == (
        "UpdateTenant: credential 'team-a' (operator) may not write tenant 'team-b': not in "
        "its tenants scope")
    # Nothing changed: team-b's tenant, key, pipeline stay as the admin left them.
    assert _call(stub, "GetTenant", admin_pb2.GetTenantRequest(name="team-b"), ROOT
                 ).tenant.priority == 0
    keys = _call(stub, "ListApiKeys", admin_pb2.ListApiKeysRequest(tenant="team-b"), ROOT).keys
    assert [(k.id, k.revoked) for k in keys] == [(b_key.key.id, False)]

    # Its own: allowed (the swap gets past the check to the swap's own validation).
    _call(stub, "UpdateTenant", admin_pb2.UpdateTenantRequest(
        tenant=admin_pb2.Tenant(name="team-a", models=["m"], priority=3)), TEAM_A)
    own = _call(stub, "CreateApiKey", admin_pb2.CreateApiKeyRequest(tenant="team-a"), TEAM_A)
    assert _call(stub, "RevokeApiKey", admin_pb2.RevokeApiKeyRequest(id=own.key.id),
                 TEAM_A).key.revoked
    assert _code(stub, "SwapModel", admin_pb2.SwapModelRequest(
        model="model-a", target_version=0), TEAM_A)[0] == grpc.StatusCode.INVALID_ARGUMENT
    _call(stub, "SetThresholds", admin_pb2.SetThresholdsRequest(pipeline="pipe-a",
                                                                yaml="policy: seed\n"), TEAM_A)
    # Operators read everything, other teams' tenants included.
    assert _call(stub, "GetTenant", admin_pb2.GetTenantRequest(name="team-b"), TEAM_A
                 ).tenant.name == "team-b"


def _empty(method: str) -> Any:
    descriptor = SERVICE.methods_by_name[method]
    request = getattr(admin_pb2, descriptor.input_type.name)()
    return iter([request]) if descriptor.client_streaming else request


def test_a_viewer_cannot_write_anything(stub: admin_pb2_grpc.AdminServiceStub) -> None:
    writes = [m for m in SERVICE.methods_by_name
              if m not in RULES or RULES[m].verb == "write"]
    assert len(writes) >= 12
    for method in writes:
        code, details = _code(stub, method, _empty(method), VIEWER)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
        assert details.startswith(f"{method}: credential 'dashboards' (viewer) may not "
                                  "write"), details
    assert [t.name for t in _call(stub, "ListTenants", admin_pb2.ListTenantsRequest(),
                                  VIEWER).tenants] >= ["team-a", "team-b"]
    # A tenant's token usage is a read: past access, team-b has no budget to show.
    for token in (VIEWER, TEAM_A):
        assert _code(stub, "GetTokenUsage", admin_pb2.GetTokenUsageRequest(tenant="team-b"),
                     token) == (grpc.StatusCode.NOT_FOUND,
                                "tenant team-b has no TokenBudget")


def test_a_wrong_or_missing_token_is_unauthenticated(
        node: harness.Sitsmesh, stub: admin_pb2_grpc.AdminServiceStub) -> None:
    request = admin_pb2.ListTenantsRequest()
    # With a file, the state dir's single admin token is not made, let alone accepted.
    assert not (node.state_dir / "admin-token").exists()
    for metadata in ((("authorization", f"Bearer {ROOT}x"),),
                     (("authorization", f"Bearer {hash_token(ROOT)}"),),
                     (("authorization", f"Basic {ROOT}"),), ()):
        code, details = _code(stub, "ListTenants", request, metadata=metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, (metadata, code)
        assert "valid token" in details
    assert harness.health_status(node.admin_addr) == tlsnode.SERVING


def test_the_audit_names_the_credential_not_the_header(
        node: harness.Sitsmesh, stub: admin_pb2_grpc.AdminServiceStub) -> None:
    claim = (("x-sitsmesh-actor", "root@somewhere"),)
    _call(stub, "SetThresholds", admin_pb2.SetThresholdsRequest(
        pipeline="pipe-a", yaml="policy: seed\n"), TEAM_A, metadata=claim)
    changes = _call(stub, "ListThresholdChanges", admin_pb2.ListThresholdChangesRequest(
        pipeline="pipe-a", page_size=1), VIEWER).changes
    assert changes[0].actor == "team-a (on behalf of root@somewhere)"
    _call(stub, "UpdateTenant", admin_pb2.UpdateTenantRequest(
        tenant=admin_pb2.Tenant(name="team-a", models=["m"])), TEAM_A)

    def audited() -> bool:
        return any(e.get("event") == "admin write" and e.get("method") == "UpdateTenant"
                   and e.get("actor") == "team-a" and e.get("resource") == "team-a"
                   for e in _log(node))
    harness.wait_until(audited, 5, "the UpdateTenant audit line")


def _log(node: harness.Sitsmesh) -> list[dict[str, Any]]:
    out = []
    for line in node.output().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_the_file_reloads_and_a_bad_reload_keeps_the_credentials_in_use(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.yaml"
    creds.write_text(_credentials())
    node = harness.start_sitsmesh(tmp_path, "--admin-credentials", str(creds))
    try:
        with grpc.insecure_channel(node.admin_addr) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            request = admin_pb2.ListTenantsRequest()
            assert _code(stub, "ListTenants", request, LATE)[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            # A changed file is picked up by itself (reload_interval_seconds), no signal.
            creds.write_text(_credentials({"name": "late", "role": "viewer",
                                           "token_hash": hash_token(LATE)}))
            harness.wait_until(lambda: _code(stub, "ListTenants", request, LATE)[0]
                               == grpc.StatusCode.OK, 10, "the reloaded credential")
            creds.write_text(_credentials({"name": "late", "role": "superuser",
                                           "token_hash": hash_token(LATE)}))
            harness.wait_until(lambda: "admin credentials not reloaded" in node.output(),
                               10, "the refused reload")
            assert _code(stub, "ListTenants", request, LATE)[0] == grpc.StatusCode.OK
            assert "unknown role 'superuser'" in node.output()
    finally:
        node.kill()


def test_sighup_reloads_the_file(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.yaml"
    creds.write_text(_credentials())
    # An interval of an hour: only the signal can be what reloads it here.
    node = harness.start_sitsmesh(tmp_path, "--admin-credentials", str(creds),
                                  "--reload-interval-seconds", "3600")
    try:
        with grpc.insecure_channel(node.admin_addr) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            request = admin_pb2.ListTenantsRequest()
            creds.write_text(_credentials({"name": "late", "role": "viewer",
                                           "token_hash": hash_token(LATE)}))
            time.sleep(0.5)
            assert _code(stub, "ListTenants", request, LATE)[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            node.proc.send_signal(signal.SIGHUP)
            harness.wait_until(lambda: _code(stub, "ListTenants", request, LATE)[0]
                               == grpc.StatusCode.OK, 10, "the credential SIGHUP loaded")
    finally:
        node.kill()


def test_serve_refuses_a_bad_credentials_file(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.yaml"
    creds.write_text(_credentials({"name": "team-b", "role": "operator",
                                   "token_hash": hash_token("b" * 40)}))
    refused = harness.run_cli("serve", "--admin-credentials", str(creds), "--state-dir",
                              str(tmp_path / "s"))
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip() == (
        f"sitsmesh: error: {creds}: credentials[4] (team-b): an operator needs scopes: some "
        "of tenants, pipelines, models, each a list of names or '*'")
    assert not (tmp_path / "s").exists()


def test_an_mtls_identity_mapped_to_operator(tmp_path: Path, ca: Ca) -> None:
    server = ca.issue("server", "DNS:localhost", "IP:127.0.0.1")
    team_ci = ca.issue("team-a-ci", "URI:spiffe://test/team-a-ci")
    intern = ca.issue("intern", "URI:spiffe://test/intern")
    creds = tmp_path / "credentials.yaml"
    creds.write_text(_credentials())
    node = tlsnode.start(tmp_path, "--admin-credentials", str(creds),
                         "--admin-tls-cert-file", str(server.cert), "--admin-tls-key-file",
                         str(server.key), "--admin-tls-client-ca-file", str(ca.cert),
                         admin=(ca.cert, team_ci))
    try:
        with tlsnode.channel(node.admin_addr, ca.cert, team_ci) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            for team in ("team-a", "team-b"):
                _call(stub, "CreateTenant", admin_pb2.CreateTenantRequest(
                    tenant=admin_pb2.Tenant(name=team, models=["m"])), ROOT)
            # No token: the certificate's SAN is the credential.
            _call(stub, "UpdateTenant", admin_pb2.UpdateTenantRequest(
                tenant=admin_pb2.Tenant(name="team-a", models=["m"], priority=2)))
            code, details = _code(stub, "UpdateTenant", admin_pb2.UpdateTenantRequest(
                tenant=admin_pb2.Tenant(name="team-b", models=["m"])))
            assert (code, details) == (grpc.StatusCode.PERMISSION_DENIED, (
                "UpdateTenant: credential 'ci-a' (operator) may not write tenant 'team-b': "
                "not in its tenants scope"))
            # A token, when sent, decides alone: a wrong one is refused despite the cert.
            assert _code(stub, "GetTenant", admin_pb2.GetTenantRequest(name="team-a"),
                         "w" * 40)[0] == grpc.StatusCode.UNAUTHENTICATED
        with tlsnode.channel(node.admin_addr, ca.cert, intern) as channel:
            assert _code(admin_pb2_grpc.AdminServiceStub(channel), "ListTenants",
                         admin_pb2.ListTenantsRequest())[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        node.kill()
