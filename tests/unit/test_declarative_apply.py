"""ConfigService.Apply over a real SQLite store: a change made between the read and the
commit fails the whole apply with ABORTED and writes nothing; otherwise all at once."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from sitsmesh.access import builtin
from sitsmesh.admin.v1 import config_pb2
from sitsmesh.authz.directory import TenantDirectory
from sitsmesh.chains.catalog import PipelineCatalog
from sitsmesh.pressure.ledger import ThresholdLedger
from sitsmesh.pressure.thresholds import AUDIT_KIND
from sitsmesh.ratelimit.reload import ConfigManager
from sitsmesh.state import Delete, Put
from sitsmesh.state.sqlite import SqliteStore
from sitsmesh.transport.admin.config import ACCESS_KIND, ConfigServicer
from sitsmesh.transport.adminaccess import AdminAccess
from sitsmesh.transport.errors import Refused

DOCS = """\
apiVersion: sitsmesh.io/v1alpha1
kind: Tenant
metadata: {name: team-a}
spec: {models: [bert], priority: %d}
---
apiVersion: sitsmesh.io/v1alpha1
kind: Thresholds
metadata: {name: checkout}
spec: {policy: seed}
"""


TOKEN = "t" * 40
ACCESS = AdminAccess(builtin(TOKEN), {})


class Context:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def set_code(self, code: grpc.StatusCode) -> None:
        self.status = (code, "")

    def set_details(self, details: str) -> None:
        assert self.status is not None
        self.status = (self.status[0], details)

    def auth_context(self) -> dict[str, Any]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {TOKEN}"),)


class RacingStore(SqliteStore):
    """Another admin changes the tenant between Apply's read and its commit."""

    race = False

    async def apply(self, writes: Sequence[Put | Delete]) -> int:
        if self.race:
            self.race = False
            record = await self.get("tenant", "team-a")
            assert record is not None
            await self.put("tenant", "team-a", {**record.body, "priority": 9})
        return await super().apply(writes)


def request(text: str) -> config_pb2.ApplyRequest:
    return config_pb2.ApplyRequest(files=[config_pb2.ApplyFile(name="c.yaml", documents=text)])


def servicer(store: SqliteStore) -> ConfigServicer:
    return ConfigServicer(store, TenantDirectory(store), PipelineCatalog(store),
                          ThresholdLedger(store), ConfigManager([], store, None), access=ACCESS)


async def test_concurrent_change_aborts_the_whole_apply(tmp_path: Path) -> None:
    store = RacingStore(tmp_path / "state.db")
    config = servicer(store)
    await config.Apply(request(DOCS % 1), Context())
    before = await store.revision()
    audits = len(await store.list(AUDIT_KIND))

    store.race = True
    context = Context()
    with pytest.raises(Refused):
        await config.Apply(request(
            (DOCS % 2).replace("policy: seed", "policy: 'off'")), context)
    assert context.status is not None
    code, details = context.status
    assert code == grpc.StatusCode.ABORTED
    assert "nothing was applied" in details
    # Only the racing write landed: neither the tenant, the thresholds nor their audit.
    assert await store.revision() == before + 1
    tenant = await store.get("tenant", "team-a")
    thresholds = await store.get("thresholds", "checkout")
    assert tenant is not None and thresholds is not None
    assert tenant.body["priority"] == 9
    assert thresholds.body["policy"] == "seed"
    assert len(await store.list(AUDIT_KIND)) == audits
    await store.close()


async def test_apply_commits_every_document_and_audits_thresholds(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    config = servicer(store)
    before = await store.revision()
    reply = await config.Apply(request(DOCS % 1), Context())
    assert reply.applied
    assert reply.revision == before + 1  # one transaction, one revision
    assert [(r.kind, r.action) for r in reply.results] == [
        ("Tenant", config_pb2.APPLY_ACTION_CREATED),
        ("Thresholds", config_pb2.APPLY_ACTION_CREATED)]
    (audit,) = await store.list(AUDIT_KIND)
    assert (audit.body["pipeline"], audit.body["actor"]) == ("checkout", "admin")
    again = await config.Apply(request(DOCS % 1), Context())
    assert not again.applied and again.revision == reply.revision
    await store.close()


async def test_structured_objects_apply_like_files(tmp_path: Path) -> None:
    from google.protobuf.struct_pb2 import Struct

    store = SqliteStore(tmp_path / "state.db")
    config = servicer(store)
    built = Struct()
    built.update({"apiVersion": "sitsmesh.io/v1alpha1", "kind": "Tenant",
                  "metadata": {"name": "team-a"}, "spec": {"models": ["bert"], "priority": 1}})
    reply = await config.Apply(config_pb2.ApplyRequest(objects=[built]), Context())
    assert [(r.name, r.action) for r in reply.results] == [
        ("team-a", config_pb2.APPLY_ACTION_CREATED)]
    # The same tenant as a file: unchanged (the Struct's 1.0 was read as the integer 1).
    again = await config.Apply(request(DOCS.split("---", maxsplit=1)[0] % 1), Context())
    assert again.results[0].action == config_pb2.APPLY_ACTION_UNCHANGED
    await store.close()


async def test_refused_like_the_imperative_rpcs(tmp_path: Path) -> None:
    """--workers N refuses pipelines and capped tenants; a rate-limit domain a file owns
    is changed in the file. Each refusal writes nothing."""
    owned = tmp_path / "owned.yaml"
    owned.write_text("domain: edge\ndescriptors:\n  - key: k\n"
                     "    rate_limit: {unit: second, requests_per_unit: 1}\n")
    store = SqliteStore(tmp_path / "state.db")
    config = ConfigServicer(store, TenantDirectory(store), PipelineCatalog(store),
                            ThresholdLedger(store), ConfigManager([owned], store, None),
                            access=ACCESS, workers=2)
    before = await store.revision()
    pipeline = ("apiVersion: sitsmesh.io/v1alpha1\nkind: Pipeline\nmetadata: {name: p}\n"
                "spec: {stages: [{name: s, match: {header: s}}]}\n")
    capped = (DOCS.split("---", maxsplit=1)[0] % 1).replace(
        "priority: 1}", "priority: 1, max_concurrency: 4}")
    edge = ("apiVersion: sitsmesh.io/v1alpha1\nkind: RateLimitConfig\nmetadata: {name: edge}\n"
            "spec: {descriptors: [{key: k, rate_limit: {unit: minute, "
            "requests_per_unit: 5}}]}\n")
    for text, code, message in (
            (pipeline, grpc.StatusCode.FAILED_PRECONDITION,
             "pipeline p: backpressure and latency chains"),
            (capped, grpc.StatusCode.FAILED_PRECONDITION, "tenant team-a: max_concurrency needs"),
            (edge, grpc.StatusCode.INVALID_ARGUMENT, "RateLimitConfig: api:edge: domain 'edge' "
             f"is defined in file {owned}; change the file instead")):
        context = Context()
        with pytest.raises(Refused):
            await config.Apply(request(text), context)
        assert context.status is not None
        assert context.status[0] == code
        assert message in context.status[1]
    assert await store.revision() == before
    await store.close()


class CreatingStore(SqliteStore):
    """Another admin creates the tenant between Apply's read and its commit."""

    race = False

    async def apply(self, writes: Sequence[Put | Delete]) -> int:
        if self.race:
            self.race = False
            await self.create("tenant", "team-a", {"models": ["*"], "uid": "theirs"})
        return await super().apply(writes)


async def test_a_record_created_meanwhile_is_not_overwritten(tmp_path: Path) -> None:
    store = CreatingStore(tmp_path / "state.db")
    store.race = True
    context = Context()
    with pytest.raises(Refused):
        await servicer(store).Apply(request(DOCS % 1), context)
    assert context.status is not None and context.status[0] == grpc.StatusCode.ABORTED
    assert "exists (at revision" in context.status[1]
    tenant = await store.get("tenant", "team-a")
    assert tenant is not None and tenant.body["uid"] == "theirs"
    assert await store.get("thresholds", "checkout") is None
    await store.close()


def test_every_kind_is_judged_by_the_access_policy() -> None:
    from sitsmesh.declarative.models import KINDS

    assert set(ACCESS_KIND) == set(KINDS)
