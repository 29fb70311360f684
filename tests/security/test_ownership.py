"""Ownership by content (issue 26, item 1), through a real `sitsmesh serve` with an
--admin-credentials file and the CLI: an operator's scopes bound what it writes, not only
the names of the objects it writes to. A tenant's models, a pipeline's models, stage
models and governed tenants, automatic batching, and the reserved `sitsmesh.io/` labels;
and a pipeline admits, sheds and counts only the requests of the tenants it governs."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness
from tests.security import credfile

pytestmark = pytest.mark.integration

ROOT, TEAM_A, TEAM_B = "r" * 40, "a" * 40, "b" * 40
OK, DENIED = 0, 7  # google.rpc codes in a CheckResponse


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Sitsmesh]:
    teams = (credfile.entry(f"team-{t}", "operator", token,
                            {"tenants": [f"team-{t}"], "pipelines": [f"pipe-{t}"],
                             "models": [f"team-{t}-*", "shared-llm"]})
             for t, token in (("a", TEAM_A), ("b", TEAM_B)))
    # Nothing answers the Triton metrics URL: a pipeline's stage is stale, and its
    # pipeline sheds (fail safe), which is what shows whose requests it governs.
    with credfile.serving(tmp_path_factory.mktemp("ownership"),
                          credfile.entry("root", "admin", ROOT), *teams,
                          args=("--triton-url", f"127.0.0.1:{_closed_port()}",
                                "--triton-metrics-url",
                                f"http://127.0.0.1:{_closed_port()}/metrics")) as started:
        with grpc.insecure_channel(started.admin_addr) as channel:
            stub = admin_pb2_grpc.AdminServiceStub(channel)
            for name, models in (("team-a", ["team-a-llm"]), ("team-b", ["team-b-llm"])):
                _admin(stub, "CreateTenant", admin_pb2.CreateTenantRequest(
                    tenant=admin_pb2.Tenant(name=name, models=models)))
        yield started


def _admin(stub: admin_pb2_grpc.AdminServiceStub, method: str, request: Any,
           token: str = ROOT) -> Any:
    return getattr(stub, method)(request, metadata=(("authorization", f"Bearer {token}"),),
                                 timeout=10)


def _code(node: harness.Sitsmesh, method: str, request: Any,
          token: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(node.admin_addr) as channel:
        try:
            _admin(admin_pb2_grpc.AdminServiceStub(channel), method, request, token)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _key(node: harness.Sitsmesh, tenant: str) -> str:
    with grpc.insecure_channel(node.admin_addr) as channel:
        secret: str = _admin(admin_pb2_grpc.AdminServiceStub(channel), "CreateApiKey",
                             admin_pb2.CreateApiKeyRequest(tenant=tenant)).secret
    return secret


def _cli(node: harness.Sitsmesh, token: str, *args: str) -> tuple[int, str]:
    done = node.cli(*args, env={"SITSMESH_ADMIN_TOKEN": token})
    return done.returncode, done.stdout + done.stderr


def check(node: harness.Sitsmesh, key: str, model: str, hint: str = "") -> int:
    ctx = attribute_context_pb2.AttributeContext
    headers = {"x-api-key": key, **({"x-sits-pipeline-hint": hint} if hint else {})}
    request = external_auth_pb2.CheckRequest(attributes=ctx(request=ctx.Request(
        http=ctx.HttpRequest(method="POST", path=f"/v2/models/{model}/infer",
                             headers=headers))))
    with grpc.insecure_channel(node.data_addr) as channel:
        reply = external_auth_pb2_grpc.AuthorizationStub(channel).Check(request, timeout=5)
    code: int = reply.status.code
    return code


def _tenant(node: harness.Sitsmesh, name: str) -> dict[str, Any]:
    code, out = _cli(node, ROOT, "tenants", "get", name, "-o", "json")
    assert code == 0, out
    found: dict[str, Any] = json.loads(out)
    return found


def test_an_operator_cannot_give_its_tenant_another_team_s_models(
        tmp_path: Path, node: harness.Sitsmesh) -> None:
    key = _key(node, "team-a")
    for models in ("team-b-llm", "team-a-llm,team-b-llm", "team-*", "*", "team-a*"):
        code, out = _cli(node, TEAM_A, "tenants", "update", "team-a", "--models", models)
        assert code == 1 and "PERMISSION_DENIED" in out, (models, out)
        assert "credential 'team-a' (operator) may not write tenant 'team-a': models[" in out
        assert "is not within its models scope" in out
    code, out = _cli(node, TEAM_A, "tenants", "update", "team-a", "--models", "team-b-llm")
    assert "models[0] 'team-b-llm' is not within its models scope" in out
    doc = tmp_path / "t.yaml"
    doc.write_text("apiVersion: sitsmesh.io/v1alpha1\nkind: Tenant\nmetadata: {name: team-a}\n"
                   "spec: {models: [team-b-llm]}\n")
    code, out = _cli(node, TEAM_A, "apply", "-f", str(doc))
    assert code == 1 and "PERMISSION_DENIED" in out, out
    assert "Tenant/team-a: credential 'team-a' (operator) may not write Tenant 'team-a': " \
           "models[0] 'team-b-llm' is not within its models scope" in out
    # Nothing changed: team-a's key still gets nothing of team-b's model.
    assert _tenant(node, "team-a")["models"] == ["team-a-llm"]
    assert check(node, key, "team-b-llm") == DENIED
    assert check(node, key, "team-a-llm") == OK

    # Within its scope: a glob inside its prefix glob, and a change that keeps models an
    # admin granted (here `legacy`, outside its scope) while changing the priority.
    code, out = _cli(node, TEAM_A, "tenants", "update", "team-a", "--models",
                     "team-a-llm,team-a-embed-*")
    assert code == 0, out
    _cli(node, ROOT, "tenants", "update", "team-a", "--models", "team-a-llm,legacy")
    code, out = _cli(node, TEAM_A, "tenants", "update", "team-a", "--priority", "2")
    assert code == 0, out
    assert _tenant(node, "team-a")["models"] == ["team-a-llm", "legacy"]


PIPELINE = ("name: {name}\n{extra}stages:\n  - name: model\n"
            "    match: {{upstream_cluster: triton}}\n    sla_p99_ms: 250\n"
            "    triton_model: {triton}\n")


def test_an_operator_s_pipeline_names_only_its_models_and_tenants(
        tmp_path: Path, node: harness.Sitsmesh) -> None:
    path = tmp_path / "p.yaml"
    for extra, triton, problem in [
        ("models: [team-b-llm]\n", "team-a-llm", "models[0] 'team-b-llm'"),
        ("models: [team-a-llm]\n", "team-b-llm", "stages[0].triton_model 'team-b-llm'"),
        ("models: ['*']\n", "team-a-llm", "models[0] '*'"),
        ("tenants: [team-b]\n", "team-a-llm", "tenants[0] 'team-b' is not within its "
                                              "tenants scope"),
    ]:
        path.write_text(PIPELINE.format(name="pipe-a", extra=extra, triton=triton))
        code, out = _cli(node, TEAM_A, "pipelines", "apply", str(path))
        assert code == 1 and "PERMISSION_DENIED" in out, (extra, out)
        assert "ApplyPipeline: credential 'team-a' (operator) may not write pipeline " \
               f"'pipe-a': {problem}" in out, out
        decl = tmp_path / "d.yaml"
        body = yaml.safe_load(path.read_text())
        decl.write_text(yaml.safe_dump({"apiVersion": "sitsmesh.io/v1alpha1",
                                        "kind": "Pipeline", "metadata": {"name": "pipe-a"},
                                        "spec": {k: v for k, v in body.items()
                                                 if k != "name"}}))
        code, out = _cli(node, TEAM_A, "apply", "-f", str(decl))
        assert code == 1 and problem in out, out
    assert _cli(node, ROOT, "pipelines", "get", "pipe-a")[0] == 1  # nothing was written

    # Its own: the pipeline governs its tenants scope when it leaves `tenants` out.
    path.write_text(PIPELINE.format(name="pipe-a", extra="models: [team-a-llm]\n",
                                    triton="team-a-llm"))
    code, out = _cli(node, TEAM_A, "pipelines", "apply", str(path))
    assert code == 0, out
    code, out = _cli(node, ROOT, "pipelines", "get", "pipe-a", "-o", "yaml")
    assert yaml.safe_load(yaml.safe_load(out)["yaml"])["tenants"] == ["team-a"], out

    # An admin may put team-b's model in team-a's pipeline; team-a still may not switch
    # automatic batching on for it.
    path.write_text(PIPELINE.format(name="pipe-a", extra="tenants: [team-a]\n",
                                    triton="team-b-llm"))
    assert _cli(node, ROOT, "pipelines", "apply", str(path))[0] == 0
    status, details = _code(node, "SetAutoTuning", admin_pb2.SetAutoTuningRequest(
        auto_tuning=admin_pb2.AutoTuning(pipeline="pipe-a", enabled=True)), TEAM_A)
    assert status == grpc.StatusCode.PERMISSION_DENIED, details
    assert "model 'team-b-llm' is not within its models scope" in details
    _cli(node, ROOT, "pipelines", "delete", "pipe-a")


def test_the_sitsmesh_io_labels_are_reserved(tmp_path: Path, node: harness.Sitsmesh) -> None:
    def tenant(name: str, owner: str, models: str) -> str:
        return (f"apiVersion: sitsmesh.io/v1alpha1\nkind: Tenant\nmetadata: {{name: {name}, "
                f"labels: {{sitsmesh.io/managed-by: {owner}}}}}\nspec: {{models: [{models}]}}\n")

    doc = tmp_path / "a.yaml"
    doc.write_text(tenant("team-a", "team-b", "team-a-llm"))
    code, out = _cli(node, TEAM_A, "apply", "-f", str(doc))
    assert code == 1 and "PERMISSION_DENIED" in out, out
    assert "metadata.labels 'sitsmesh.io/managed-by=team-b' is reserved" in out
    code, out = _cli(node, TEAM_A, "tenants", "update", "team-a", "--label",
                     "sitsmesh.io/managed-by=team-b")
    assert code == 1 and "labels 'sitsmesh.io/managed-by=team-b' is reserved" in out, out
    # So team-b's own prune is not refused for team-a's tenant, nor does it reach it.
    mine = tmp_path / "b.yaml"
    mine.write_text(tenant("team-b", "team-b", "team-b-llm"))
    code, out = _cli(node, TEAM_B, "apply", "-f", str(mine), "--prune", "-l",
                     "sitsmesh.io/managed-by=team-b")
    assert code == 0, out
    assert _tenant(node, "team-a")["name"] == "team-a"
    # Its own name is the one value an operator may set.
    doc.write_text(tenant("team-a", "team-a", "team-a-llm"))
    code, out = _cli(node, TEAM_A, "apply", "-f", str(doc))
    assert code == 0, out


def test_a_pipeline_governs_only_the_tenants_of_its_owner(
        tmp_path: Path, node: harness.Sitsmesh) -> None:
    for name in ("team-a", "team-b"):
        _cli(node, ROOT, "tenants", "update", name, "--models", f"{name}-llm,shared-llm")
    keys = {name: _key(node, name) for name in ("team-a", "team-b")}
    path = tmp_path / "shared.yaml"
    path.write_text(PIPELINE.format(name="pipe-a", extra="models: [shared-llm]\n",
                                    triton="shared-llm"))
    code, out = _cli(node, TEAM_A, "pipelines", "apply", str(path))
    assert code == 0, out
    # The stage's Triton does not answer: the pipeline sheds what it governs.
    def stale() -> bool:
        code, out = _cli(node, ROOT, "pressure", "watch", "pipe-a", "--count", "1",
                         "-o", "json")
        return code == 0 and json.loads(out)["pipelines"][0]["level"] == "stale"

    harness.wait_until(stale, 20, "pipe-a to go stale", interval=0.5)
    a_codes = [check(node, keys["team-a"], "shared-llm") for _ in range(30)]
    b_codes = [check(node, keys["team-b"], "shared-llm") for _ in range(30)]
    hinted = [check(node, keys["team-b"], "shared-llm", hint="pipe-a") for _ in range(10)]
    assert any(c != OK for c in a_codes), a_codes  # team-a's own: shed
    assert b_codes == [OK] * 30 and hinted == [OK] * 10, (b_codes, hinted)
    _cli(node, ROOT, "pipelines", "delete", "pipe-a")
