"""sitsmesh.client against a real `sitsmesh serve`: sync and async, paged lists, read masks,
errors as one exception type with the gRPC code, deadlines, and mTLS."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from sitsmesh.client import AdminError, AsyncClient, Client, Tls, admin_pb2
from sitsmesh.dev import harness
from tests.security import tlsnode
from tests.security.pki import make_ca

pytestmark = pytest.mark.integration

PIPELINE = """name: duo
stages:
  - name: front
    match: {upstream_cluster: front}
  - name: back
    match: {upstream_cluster: back}
"""


def test_sync_client_manages_tenants_keys_and_pipelines(sitsmesh: harness.Sitsmesh) -> None:
    with Client(sitsmesh.admin_addr, sitsmesh.token) as admin:
        assert admin.status().version
        for i in range(7):
            admin.create_tenant(admin_pb2.Tenant(name=f"t{i}", models=["m*"], max_priority=4))
        updated = admin.update_tenant(admin_pb2.Tenant(name="t3", models=["x"], priority=2,
                                                       max_priority=4))
        assert (list(updated.models), updated.priority) == (["x"], 2)
        # Three per page: the iterator crosses pages without the caller seeing them.
        assert [t.name for t in admin.tenants(page_size=3)] == [f"t{i}" for i in range(7)]
        assert list(admin.tenants("name", page_size=3)) == [
            admin_pb2.Tenant(name=f"t{i}") for i in range(7)]
        assert admin.get_tenant("t3", "models") == admin_pb2.Tenant(models=["x"])

        key, secret = admin.create_api_key("t1", "ci", expires_at=time.time() + 3600)
        assert secret and key.tenant == "t1" and key.HasField("expires_at")
        assert [k.id for k in admin.api_keys("t1", page_size=1)] == [key.id]
        assert admin.revoke_api_key(key.id).revoked

        assert admin.apply_pipeline(PIPELINE, "duo.yaml").name == "duo"
        assert [p.name for p in admin.pipelines()] == ["duo"]
        assert admin.get_pipeline("duo", "name") == admin_pb2.Pipeline(name="duo")
        for fill in ("0.7", "0.6"):
            admin.set_thresholds("duo", f"queue_fill_high: {fill}\n")
        assert admin.get_thresholds("duo").yaml.count("queue_fill_high: 0.6") == 1
        assert [c.pipeline for c in admin.threshold_changes("duo", page_size=1)] == ["duo"] * 2
        assert list(admin.swaps()) == []
        admin.delete_tenant("t6")
        assert "t6" not in {t.name for t in admin.tenants()}

        with pytest.raises(AdminError) as missing:
            admin.get_tenant("nobody")
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        assert missing.value.message == "tenant nobody does not exist"
        with pytest.raises(AdminError) as masked:
            admin.get_tenant("t1", "secret")
        assert masked.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(AdminError) as paged:
            next(iter(admin.tenants(page_size=-1)))
        assert paged.value.code == grpc.StatusCode.INVALID_ARGUMENT

    with Client(sitsmesh.admin_addr, "wrong-token") as intruder, \
            pytest.raises(AdminError) as denied:
        intruder.status()
    assert denied.value.code == grpc.StatusCode.UNAUTHENTICATED


async def test_async_client_pages_and_maps_errors(sitsmesh: harness.Sitsmesh) -> None:
    async with AsyncClient(sitsmesh.admin_addr, sitsmesh.token) as admin:
        assert (await admin.status()).admin_addr == sitsmesh.admin_addr
        for i in range(5):
            await admin.create_tenant(admin_pb2.Tenant(name=f"a{i}", models=["*"],
                                                       max_priority=1))
        names = [t.name async for t in admin.tenants(page_size=2)]
        assert names == [f"a{i}" for i in range(5)]
        key, _ = await admin.create_api_key("a0")
        assert [k.id async for k in admin.api_keys(page_size=1)] == [key.id]
        with pytest.raises(AdminError) as err:
            await admin.create_tenant(admin_pb2.Tenant(name="a0", models=["*"]))
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(AdminError) as stream_err:
            async for _ in admin.watch_pressure("no-such-pipeline", count=1):
                pass
        assert stream_err.value.code in (grpc.StatusCode.NOT_FOUND,
                                         grpc.StatusCode.FAILED_PRECONDITION)


def test_a_deadline_ends_a_stream_as_deadline_exceeded(sitsmesh: harness.Sitsmesh) -> None:
    # WatchPressure with no count never ends by itself: only the deadline stops it.
    with Client(sitsmesh.admin_addr, sitsmesh.token) as admin:
        with pytest.raises(AdminError) as err:
            for _ in admin.watch_pressure(deadline=1.0):
                pass
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Or the caller, stopping early: the stream ends there, without an error.
        for snapshot in admin.watch_pressure():
            assert snapshot.HasField("at")
            break
        assert admin.status().version


def test_the_client_speaks_mtls(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "pki")
    server = ca.issue("server", "DNS:localhost", "IP:127.0.0.1")
    sre = ca.issue("sre", "URI:spiffe://test/sre")
    node = tlsnode.start(tmp_path, "--admin-tls-cert-file", str(server.cert),
                         "--admin-tls-key-file", str(server.key),
                         "--admin-tls-client-ca-file", str(ca.cert), admin=(ca.cert, sre))
    try:
        tls = Tls(ca_file=ca.cert, cert_file=sre.cert, key_file=sre.key)
        with Client(node.admin_addr, node.token, tls=tls) as admin:
            assert admin.status().version
        # Without a client certificate the handshake fails: UNAVAILABLE, as one AdminError.
        with Client(node.admin_addr, node.token, tls=Tls(ca_file=ca.cert), timeout=3) as bare, \
                pytest.raises(AdminError) as err:
            bare.status()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        node.kill()


def test_the_readme_example_runs(sitsmesh: harness.Sitsmesh, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### Python client"):]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    token = tmp_path / ".local" / "state" / "sitsmesh" / "admin-token"
    token.parent.mkdir(parents=True)
    token.write_text(sitsmesh.token + "\n")
    monkeypatch.setattr(Path, "home", lambda: tmp_path)
    exec(compile(example.replace("127.0.0.1:50052", sitsmesh.admin_addr), "README", "exec"),
         {})
    assert capsys.readouterr().out == ("acme ['llama-*']\n"
                                       "NOT_FOUND tenant nobody does not exist\n")
