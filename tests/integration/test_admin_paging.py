"""Paging and read masks through a real `sitsmesh serve`: more tenants and API keys than
one page holds, listed by the RPC page by page and by the CLI in one go."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from sitsmesh.admin.v1 import admin_pb2, admin_pb2_grpc
from sitsmesh.dev import harness

pytestmark = pytest.mark.integration

TENANTS = 130  # more than the default page (100)
KEYS = 110


@pytest.fixture
def stub(sitsmesh: harness.Sitsmesh) -> Iterator[tuple[admin_pb2_grpc.AdminServiceStub,
                                                       tuple[tuple[str, str], ...]]]:
    with grpc.insecure_channel(sitsmesh.admin_addr) as channel:
        yield admin_pb2_grpc.AdminServiceStub(channel), sitsmesh.admin_metadata()


def _fill(stub: admin_pb2_grpc.AdminServiceStub, md: tuple[tuple[str, str], ...]) -> None:
    for i in range(TENANTS):
        stub.CreateTenant(admin_pb2.CreateTenantRequest(tenant=admin_pb2.Tenant(
            name=f"team-{i:03d}", models=["m*"], priority=1, max_priority=3)),
            metadata=md, timeout=5)
    for i in range(KEYS):
        stub.CreateApiKey(admin_pb2.CreateApiKeyRequest(tenant=f"team-{i % 2:03d}",
                                                        name=f"k{i}"), metadata=md, timeout=5)


def test_lists_page_through_everything_and_the_cli_joins_the_pages(
        sitsmesh: harness.Sitsmesh,
        stub: tuple[admin_pb2_grpc.AdminServiceStub, tuple[tuple[str, str], ...]]) -> None:
    admin, md = stub
    _fill(admin, md)

    names: list[str] = []
    request = admin_pb2.ListTenantsRequest(page_size=50)
    pages = 0
    while True:
        reply = admin.ListTenants(request, metadata=md, timeout=5)
        assert len(reply.tenants) <= 50
        names += [t.name for t in reply.tenants]
        pages += 1
        if not reply.next_page_token:
            break
        request.page_token = reply.next_page_token
    assert (names, pages) == ([f"team-{i:03d}" for i in range(TENANTS)], 3)
    # Without page_size, the default page: 100 of them and a token.
    first = admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=md, timeout=5)
    assert len(first.tenants) == 100 and first.next_page_token

    # One tenant's keys, 20 per page, the filter kept across pages.
    keys: list[str] = []
    key_request = admin_pb2.ListApiKeysRequest(tenant="team-001", page_size=20)
    while True:
        key_reply = admin.ListApiKeys(key_request, metadata=md, timeout=5)
        assert {k.tenant for k in key_reply.keys} <= {"team-001"}
        keys += [k.id for k in key_reply.keys]
        if not key_reply.next_page_token:
            break
        key_request.page_token = key_reply.next_page_token
    assert len(keys) == len(set(keys)) == KEYS // 2

    # The CLI lists everything, whatever the page size, in the same output as before.
    listed = sitsmesh.cli("tenants", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert [t["name"] for t in doc["tenants"]] == [f"team-{i:03d}" for i in range(TENANTS)]
    assert "next_page_token" not in doc
    listed = sitsmesh.cli("apikeys", "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert len({k["id"] for k in json.loads(listed.stdout)["keys"]}) == KEYS


def test_read_masks_trim_and_bad_paging_input_is_refused(
        stub: tuple[admin_pb2_grpc.AdminServiceStub, tuple[tuple[str, str], ...]]) -> None:
    admin, md = stub
    _fill(admin, md)
    reply = admin.ListTenants(admin_pb2.ListTenantsRequest(
        page_size=3, read_mask=FieldMask(paths=["name"])), metadata=md, timeout=5)
    assert list(reply.tenants) == [admin_pb2.Tenant(name=f"team-{i:03d}") for i in range(3)]
    got = admin.GetTenant(admin_pb2.GetTenantRequest(
        name="team-007", read_mask=FieldMask(paths=["max_priority"])), metadata=md, timeout=5)
    assert got.tenant == admin_pb2.Tenant(max_priority=3)
    keys = admin.ListApiKeys(admin_pb2.ListApiKeysRequest(
        page_size=2, read_mask=FieldMask(paths=["id", "tenant"])), metadata=md, timeout=5)
    assert all(k.id and k.tenant and not k.name and not k.HasField("created_at")
               for k in keys.keys)

    token = reply.next_page_token
    # The first character carries six bits of the signed payload: any other one is a forgery.
    forged = ("B" if token.startswith("A") else "A") + token[1:]
    bad = [
        admin_pb2.ListTenantsRequest(page_token=forged),
        admin_pb2.ListTenantsRequest(page_token="not a token"),
        admin_pb2.ListTenantsRequest(page_size=-5),
        admin_pb2.ListTenantsRequest(read_mask=FieldMask(paths=["name", "secret"])),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as err:
            admin.ListTenants(request, metadata=md, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
    # A token of one list is no good for another.
    with pytest.raises(grpc.RpcError) as err:
        admin.ListApiKeys(admin_pb2.ListApiKeysRequest(page_token=token), metadata=md,
                          timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token is not one this API issued" in (err.value.details() or "")


PIPELINE = """name: duo
stages:
  - name: front
    match: {upstream_cluster: front}
"""


def test_threshold_changes_page_newest_first_and_the_cli_honours_its_limit(
        sitsmesh: harness.Sitsmesh,
        stub: tuple[admin_pb2_grpc.AdminServiceStub, tuple[tuple[str, str], ...]]) -> None:
    admin, md = stub
    admin.ApplyPipeline(admin_pb2.ApplyPipelineRequest(yaml=PIPELINE), metadata=md, timeout=5)
    for i in range(5):
        admin.SetThresholds(admin_pb2.SetThresholdsRequest(
            pipeline="duo", yaml=f"queue_fill_high: 0.{i + 5}\n"), metadata=md, timeout=5)
    whole = admin.ListThresholdChanges(admin_pb2.ListThresholdChangesRequest(pipeline="duo"),
                                       metadata=md, timeout=5)
    stamps = [c.at.ToNanoseconds() for c in whole.changes]
    assert len(stamps) == 5 and stamps == sorted(stamps, reverse=True)
    assert not whole.next_page_token

    paged: list[admin_pb2.ThresholdChange] = []
    request = admin_pb2.ListThresholdChangesRequest(
        pipeline="duo", page_size=2, read_mask=FieldMask(paths=["at", "after"]))
    while True:
        reply = admin.ListThresholdChanges(request, metadata=md, timeout=5)
        paged += reply.changes
        if not reply.next_page_token:
            break
        request.page_token = reply.next_page_token
    assert [(c.at, c.after) for c in paged] == [(c.at, c.after) for c in whole.changes]
    assert not any(c.pipeline or c.actor for c in paged)  # trimmed by the mask

    three = sitsmesh.cli("thresholds", "history", "duo", "--limit", "3", "-o", "json")
    assert three.returncode == 0, three.stderr
    assert [c["after"]["queue_fill_high"] for c in json.loads(three.stdout)] == [
        0.9, 0.8, 0.7]
    every = sitsmesh.cli("thresholds", "history", "--limit", "0", "-o", "json")
    assert len(json.loads(every.stdout)) == 5
